"""The C++ row-wise argmax (kernels/cpu/argmax_rows.cpp) against torch's max(dim=-1).indices, the
reference's definition: the first of equal maxima, and in a row holding a NaN its first NaN."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.kernels import cpu, reference
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import avx512_available

# Below 32 values a row is scanned one at a time; 16 lanes, then a tail of vocab % 16.
VOCABS = [1, 15, 31, 32, 33, 47, 64, 1000, 49152, 49159]


@pytest.fixture
def ext():
    return load_extension()


def expected(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


@pytest.mark.parametrize("vocab", VOCABS)
def test_random_rows(ext, vocab):
    x = torch.randn(37, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(ext.argmax_rows(x), expected(x))


@pytest.mark.parametrize("vocab", VOCABS)
def test_ties_take_the_first_maximum(ext, vocab):
    """Equal maxima in several lanes, in the same lane, in the first block and in the tail."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, vocab, generator=g)
    for r in range(64):
        where = torch.randint(0, vocab, (1 + r % 4,), generator=g)
        x[r, where] = 9.0
    x[0, :] = 3.0  # all equal: index 0
    if vocab > 20:
        x[1, [vocab - 1, 17, 1]] = 50.0  # first block, second block, tail
        x[2, [vocab - 1, vocab - 2]] = 60.0  # tail only
        x[3, [16, 32 if vocab > 32 else 16]] = 70.0  # the same lane in two blocks
    assert torch.equal(ext.argmax_rows(x), expected(x))


@pytest.mark.parametrize("vocab", VOCABS)
def test_nan_and_infinities(ext, vocab):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, vocab, generator=g)
    x[0, vocab // 2] = float("nan")
    x[1, [vocab - 1, vocab // 3]] = float("nan")  # the first NaN wins, wherever the second is
    x[2, :] = float("-inf")
    x[3, vocab // 2:] = float("-inf")  # masked tokens (structured output, banned ids)
    x[4, [0, vocab - 1]] = float("inf")
    x[5, vocab - 1] = float("nan")  # a NaN in the tail only
    x[6, :] = float("nan")
    assert torch.equal(ext.argmax_rows(x), expected(x))


def test_empty_batch_and_bad_arguments(ext):
    assert ext.argmax_rows(torch.zeros(0, 100)).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.argmax_rows(torch.zeros(4, 100, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.argmax_rows(torch.zeros(100, 4).t())
    with pytest.raises(RuntimeError, match="vocab size 0"):
        ext.argmax_rows(torch.zeros(3, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_backend_entry_takes_any_logits(dtype):
    """bf16 / fp16 / strided logits take the reference; fp32 the kernel where AVX-512 runs."""
    x = torch.randn(9, 4099, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[4, 100] = x[4, 3000] = 40
    assert torch.equal(cpu.argmax_rows(x), reference.argmax_rows(x))
    assert torch.equal(cpu.argmax_rows(x[:, ::2]), reference.argmax_rows(x[:, ::2]))


def test_the_engine_samples_greedy_rows_through_the_backend(monkeypatch, tiny_model_dir):
    """ModelRunner builds its Sampler with the backend's argmax_rows; greedy tokens the sampler
    picks come from it (logprobs asked, so the steps take the logits path: greedy-only steps are
    tests/test_greedy_tokens.py's)."""
    calls = []

    def counted(x):
        calls.append(tuple(x.shape))
        return reference.argmax_rows(x)

    monkeypatch.setattr(cpu, "argmax_rows", counted)
    engine = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32",
                                               "attention_backend": "cpu"}))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    out = engine.generate([[5, 6, 7], [8, 9]], [params] * 2)
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert engine.runner.sampler.argmax_rows is counted
    assert calls and all(rows <= 2 for rows, _ in calls)


@pytest.mark.skipif(not avx512_available(), reason="the kernel runs on CPUs with AVX-512 only")
def test_the_backend_entry_takes_the_kernel_for_fp32(monkeypatch, ext):
    seen = []
    monkeypatch.setattr("pagedserve.kernels.cpu.sampling.load_extension", lambda: seen.append(1) or ext)
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(cpu.argmax_rows(x), expected(x)) and seen == [1]
