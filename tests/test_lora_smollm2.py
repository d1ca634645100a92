"""Multi-LoRA on the embedded SmolLM2-135M (real text), against PEFT: two adapters and the base
model in one batch, token-exact in fp32 (slow)."""

from __future__ import annotations

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.models.default_model import resolve_model_path
from pagedserve.core.sampling_params import SamplingParams

from tests.lora_oracle import make_adapter, peft_greedy
from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = ["What is the capital of France?", "List three uses for a paperclip.",
           "Explain in one sentence why the sky is blue."]


def test_two_adapters_and_base_in_one_batch_match_peft(tmp_path):
    base = resolve_model_path("default")
    adapters = {
        "all": make_adapter(base, tmp_path / "all", r=8, alpha=16, seed=1, std=0.02),
        "attn": make_adapter(base, tmp_path / "attn", r=16, alpha=16, seed=2, std=0.02, use_rslora=True,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    }
    engine = LLMEngine(EngineConfig.from_dict({
        "model": "default", "dtype": "float32", "max_model_len": 1024, "enable_lora": True, "max_loras": 2,
        "lora_modules": {k: str(v) for k, v in adapters.items()}}))
    prompts = [engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    names = ["all", "attn", None]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [(p, names[(i + j) % 3]) for i, p in enumerate(prompts) for j in range(3)]
    ids = [engine.add_request(None, p, params, lora_name=name) for p, name in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if first:
            assert engine.lora_stats().running == ("all", "attn")  # both adapters and the base in one step
            first = False
    changed = set()
    for (prompt, name), rid in zip(requests, ids):
        want = hf_greedy(base, prompt, MAX_TOKENS) if name is None else peft_greedy(base, adapters[name], prompt,
                                                                                      MAX_TOKENS)
        assert tokens[rid] == want, (name, engine.tokenizer.decode(prompt))
        if tokens[rid] != hf_greedy(base, prompt, MAX_TOKENS):
            changed.add(name)
    assert changed == {"all", "attn"}  # each adapter changes some text (else the test proves nothing)
