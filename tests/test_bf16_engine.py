"""The engine in bf16, the dtype "auto" picks on GPUs and on AMX / AVX512-BF16 CPUs.

bf16 rounds differently from transformers' fp32 (and from its own bf16, op order differs), so
greedy ids cannot be compared exactly. The oracle is transformers, teacher-forced on the engine's
own output: at every position the token the engine chose must be the fp32 model's argmax or
within bf16 noise of it, measured as how far transformers' own bf16 logits stray from its fp32
logits there (a faithful bf16 model can pick a token up to twice that below the max). Most
tokens must be the fp32 argmax itself.

The cpu backend runs twice: with the bf16 kernels this CPU gets, and with the other family's
(native_bf16 flipped: on a CPU without bf16 instructions the dot-product kernel, emulated, and
bf16 SDPA for prefill; on one with them, the fp32-math kernels), so both are checked end to end on
every AVX-512 CPU.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.sampling_params import SamplingParams
from pagedserve.kernels.cpu import linear as cpu_linear

from tests.oracle import hf_model
from tests.test_engine_vs_transformers import assert_all_free, make_engine, random_prompts

MAX_TOKENS = 24


def logits_at_choices(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab] in fp32: the model's logits at each position where the engine chose."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


@pytest.fixture
def flipped_native_bf16(monkeypatch):
    """The kernel choice of a CPU whose answer to native_bf16() is the opposite of this one's."""
    native = cpu_linear.native_bf16()
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: not native)
    cpu_linear._available.cache_clear()
    yield
    monkeypatch.undo()
    cpu_linear._available.cache_clear()


@pytest.mark.parametrize("backend", ["cpu", "cpu-flipped-native-bf16", "reference"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_greedy_follows_the_fp32_model(tiny_model_dir, request, family, backend):
    path = tiny_model_dir(family)
    if backend == "cpu-flipped-native-bf16":
        request.getfixturevalue("flipped_native_bf16")
        backend = "cpu"
    # budget 40 cuts prompts mid-block, so steps mix prefill chunks with decode rows
    engine = make_engine(path, dtype="bfloat16", attention_backend=backend, block_size=16,
                         max_num_batched_tokens=40)
    assert engine.dtype == torch.bfloat16
    prompts = random_prompts(8, 3, 70, seed=21)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    exact = total = 0
    for prompt, res in zip(prompts, results):
        generated = list(res.token_ids)
        assert len(generated) == MAX_TOKENS
        logits = logits_at_choices(hf_model(path), prompt, generated)
        bf16_logits = logits_at_choices(hf_model(path, torch.bfloat16), prompt, generated)
        bf16_noise = (bf16_logits - logits).abs().max(-1).values
        best = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
        worst = int((best - chosen - 2 * bf16_noise).argmax())
        assert best[worst] - chosen[worst] <= 2 * bf16_noise[worst], (
            f"prompt of {len(prompt)}, token {worst}: {best[worst] - chosen[worst]:.4f} below the fp32 argmax, "
            f"bf16 noise there {bf16_noise[worst]:.4f}")
        exact += int((chosen == best).sum())
        total += len(generated)
    assert exact >= 0.9 * total, f"only {exact}/{total} tokens are the fp32 argmax"
    assert_all_free(engine)
