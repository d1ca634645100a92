"""The linear kernels shared with the helper thread (kernels/cpu/work_share.h): at one OpenMP
thread, with the helper on, every kernel that goes through work_share::run must give the same bits
as without the helper (plain, fp32_out, out=, fused argmax, gated epilogue), whether the helper
computed some chunks, or the engine thread took them back from a helper that stalls after
claiming them (the test delay stands in for a descheduled helper). The counters show which path ran."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedserve.kernels.cpu import linear as cpu_linear
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import (AMX_BF16, AVX2_FP32, AVX512_BF16_DOT, AVX512_BF16_FP32_MATH, AVX512_FP32,
                                           packed_linear)

needs_avx512 = pytest.mark.skipif(not cpu_linear.avx512_available(), reason="this CPU has no AVX-512")
needs_amx = pytest.mark.skipif(not cpu_linear.amx_available(), reason="this CPU has no AMX bf16")
needs_avx2 = pytest.mark.skipif(not cpu_linear.avx2_fp32_available(), reason="this CPU has no AVX2 with FMA")
KERNELS = [pytest.param(AVX512_FP32, torch.float32, marks=needs_avx512, id="fp32"),
           pytest.param(AVX2_FP32, torch.float32, marks=needs_avx2, id="avx2-fp32"),
           pytest.param(AVX512_BF16_FP32_MATH, torch.bfloat16, marks=needs_avx512, id="bf16-fp32-math"),
           pytest.param(AVX512_BF16_DOT, torch.bfloat16, marks=needs_avx512, id="bf16-dot"),
           pytest.param(AMX_BF16, torch.bfloat16, marks=needs_amx, id="amx")]


def randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def ext():
    """One OpenMP thread (the governor's setting beside a neighbour); the helper off afterwards."""
    ext, before = load_extension(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield ext
    ext.work_share_set_helper(False, -1)
    ext.work_share_set_test_delay_us(0)
    torch.set_num_threads(before)


def share_until_the_helper_takes_part(ext, stall_us, call):
    """Turns the helper on (stalling stall_us after each claim) and runs `call`, which checks its
    own result, until the helper took part: committed a chunk, or, stalling, had one taken back by
    the engine thread. A helper that never does means the call did not go through work_share::run."""
    ext.work_share_set_test_delay_us(stall_us)
    ext.work_share_set_helper(True, -1)
    _, committed0, stolen0 = ext.work_share_stats()
    for _ in range(100):
        call()
        _, committed, stolen = ext.work_share_stats()
        if (stolen > stolen0) if stall_us else (committed > committed0):
            return
    pytest.fail("the helper never took part: the calls did not go through work_share::run")


def outputs(linear, x, bias):
    """Everything the layer computes through work_share::run, as tensors."""
    got = {"plain": linear(x, bias)}
    if x.dtype == torch.bfloat16:
        got["fp32_out"] = linear(x, bias, fp32_out=True)
    out = torch.full_like(got["plain"], float("nan"))
    got["out="] = linear(x, bias, out=out)
    assert got["out="].data_ptr() == out.data_ptr()
    if hasattr(linear, "argmax"):
        got["argmax"] = linear.argmax(x, bias)
    if hasattr(linear, "gated"):
        got["silu"] = linear.gated(x, bias, "silu")
        got["gelu_tanh"] = linear.gated(x, bias, "gelu_tanh")
    return got


def assert_same_bits(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key].view(torch.uint8) if got[key].is_floating_point() else got[key],
                           want[key].view(torch.uint8) if want[key].is_floating_point() else want[key]), key


@pytest.mark.parametrize("kernel,dtype", KERNELS)
@pytest.mark.parametrize("rows", [1, 13, 64, 97])
@pytest.mark.parametrize("stall_us", [0, 300], ids=["helper-computes", "helper-stalls"])
def test_shared_call_gives_the_one_thread_bits(ext, kernel, dtype, rows, stall_us):
    """4096 columns = 128 units of 32 (chunks of 2): enough that a spinning helper claims some.
    Ties (columns 2048 on repeat 0-2047) check that the argmax still takes the first maximum when
    chunks come back in any order."""
    w, x = randn(4096, 128, seed=1, dtype=dtype), randn(rows, 128, seed=2, dtype=dtype)
    w[2048:] = w[:2048]
    bias = randn(2048, seed=3, dtype=dtype).repeat(2)
    linear = packed_linear(kernel, w)
    want = outputs(linear, x, bias)  # the helper off: at::parallel_for with one thread
    share_until_the_helper_takes_part(ext, stall_us, lambda: assert_same_bits(outputs(linear, x, bias), want))


def test_other_threads_and_larger_teams_do_not_share(ext):
    """Only the thread that turned the helper on shares, and only at one OpenMP thread: another
    thread, or a team of two, runs the kernel as before (the helper's counters do not move)."""
    if not (cpu_linear.avx512_available() or cpu_linear.avx2_fp32_available()):
        pytest.skip("no packed fp32 linear kernel on this CPU")
    w, x = randn(4096, 128, seed=1, dtype=torch.float32), randn(64, 128, seed=2, dtype=torch.float32)
    kernel = AVX512_FP32 if cpu_linear.avx512_available() else AVX2_FP32
    linear = packed_linear(kernel, w)
    ext.work_share_set_test_delay_us(300)  # every chunk the helper claims would be taken back
    ext.work_share_set_helper(True, -1)
    before = ext.work_share_stats()[1:]
    torch.set_num_threads(2)
    for _ in range(20):
        linear(x, None)
    torch.set_num_threads(1)
    import threading
    other = threading.Thread(target=lambda: [linear(x, None) for _ in range(20)])
    other.start()
    other.join()
    assert ext.work_share_stats()[1:] == before


DECODE_SPECS = {"decodes": [(c, 1) for c in (0, 1, 15, 16, 17, 100, 257, 700)] * 3,
                "long": [(257, 1), (1000, 1), (5, 3), (3000, 1)]}


@pytest.mark.parametrize("specs", DECODE_SPECS.values(), ids=DECODE_SPECS.keys())
@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.int8)], ids=["fp32", "bf16", "int8-cache"])
@pytest.mark.parametrize("stall_us", [0, 300], ids=["helper-computes", "helper-stalls"])
def test_shared_decode_attention_gives_the_two_thread_bits(ext, specs, query_dtype, cache_dtype, stall_us):
    """Shared, the decode kernel cuts its items as for two threads (long contexts split into ranges
    merged by log-sum-exp), so its bits are the two-thread team's, whoever attended which item;
    prefill rows (5, 3) stay untouched. The dense oracle is test_cpu_attention.py's."""
    from tests.kernels.quant_batches import make_kv_batch
    args, _ = make_kv_batch(specs, cache_dtype=cache_dtype, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                            query_dtype=query_dtype)

    def attend():
        out = torch.zeros_like(args["query"])
        ext.paged_decode_attention(out, args["query"], args["key_cache"], args["value_cache"], args["block_table"],
                                   args["query_start_loc"], args["seq_lens"], 0.125, 0, args.get("k_scale"),
                                   args.get("v_scale"), None, 0.0)
        return out

    torch.set_num_threads(2)
    want = attend()
    torch.set_num_threads(1)

    def same_bits():
        assert torch.equal(attend().view(torch.uint8), want.view(torch.uint8))

    share_until_the_helper_takes_part(ext, stall_us, same_bits)


def test_turning_the_helper_off_releases_what_it_held(ext):
    """Tasks hold their tensors for a helper that may finish late; the jobs it is done with are
    released on the engine thread, at its next call or when the helper is turned off. A model
    dropped after that must be freed, not kept alive by the helper."""
    import gc
    import weakref

    if not (cpu_linear.avx512_available() or cpu_linear.avx2_fp32_available()):
        pytest.skip("no packed fp32 linear kernel on this CPU")
    kernel = AVX512_FP32 if cpu_linear.avx512_available() else AVX2_FP32
    linear = packed_linear(kernel, randn(4096, 128, seed=1, dtype=torch.float32))
    x = randn(64, 128, seed=2, dtype=torch.float32)
    share_until_the_helper_takes_part(ext, 0, functools.partial(linear, x, None))  # dropped on return
    weights = weakref.ref(linear.packed)
    ext.work_share_set_helper(False, -1)
    del linear
    gc.collect()
    assert weights() is None, "the packed weight outlived its layer: a job still held it"
