"""One argument contract (pagedserve.kernels.contract) for every implementation of the paged-KV
kernels: each rejects the same bad arguments with the same message, before any arithmetic.
The CPU K/V store of float caches is the exception: its C++ kernel checks the same contract
itself (TORCH_CHECK, a RuntimeError), so only its quantized path, the reference's, is here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedserve.kernels import cpu, reference

from tests.kernels.quant_batches import make_kv_batch

IMPLEMENTATIONS = ["reference", "cpu", "triton"]


def kernels(name: str):
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed (pip install -e '.[dev]')")
        from pagedserve.kernels import triton as tri

        return tri
    if name == "cpu":
        from pagedserve.kernels.cpu.build import load_extension

        try:
            load_extension()
        except Exception as exc:  # noqa: BLE001 - no compiler here: the reference path serves instead
            pytest.skip(f"the CPU kernels cannot be built here: {exc}")
        return cpu
    return reference


def batch(cache_dtype=torch.float32):
    args, _ = make_kv_batch([(3, 1), (0, 4)], cache_dtype=cache_dtype, num_kv_heads=1, group=2, head_dim=64,
                            block_size=16)
    return args


BAD_ATTENTION = [
    ("block_table int64", lambda a: {"block_table": a["block_table"].long()}, "block_table must be int32"),
    ("query fp64", lambda a: {"query": a["query"].double()}, "query dtype"),
    ("query head_dim", lambda a: {"query": a["query"][..., :32].contiguous()}, "query must be"),
    ("seq_lens int64", lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens must be int32"),
    ("query_start_loc length", lambda a: {"query_start_loc": a["query_start_loc"][:-1]}, "query_start_loc must be"),
    ("cache dtypes", lambda a: {"value_cache": a["value_cache"].half()}, "cache dtypes differ"),
    ("max_seq_len", lambda a: {"max_seq_len": a["block_table"].shape[1] * 16 + 1}, "block_table holds"),
    ("window", lambda a: {"sliding_window": 0}, "sliding_window must be positive"),
    ("float cache with scales", lambda a: {"k_scale": torch.ones(()), "v_scale": torch.ones(())}, "takes no k_scale"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case, change, message", BAD_ATTENTION, ids=[c[0] for c in BAD_ATTENTION])
def test_paged_attention_rejects_the_same_arguments(impl, case, change, message):
    k = kernels(impl)
    args = batch()
    with pytest.raises(AssertionError, match=message):
        k.paged_attention(**{**args, **change(args)}, scale=0.125)


def test_a_quantized_cache_needs_its_scales_everywhere():
    for impl in IMPLEMENTATIONS:
        if impl == "triton" and importlib.util.find_spec("triton") is None:
            continue
        args = batch(torch.int8)
        with pytest.raises(AssertionError, match="needs k_scale and v_scale"):
            kernels(impl).paged_attention(**{**args, "k_scale": None, "v_scale": None}, scale=0.125)


BAD_STORE = [
    ("slot_mapping int32", {"slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping must be int64"),
    ("slot_mapping length", {"slot_mapping": torch.tensor([0, 1, 2])}, "slot_mapping must be int64"),
    ("key heads", {"key": torch.randn(2, 2, 64)}, "key must be"),
    ("value head_dim", {"value": torch.randn(2, 1, 32)}, "value must be"),
    ("key fp64", {"key": torch.randn(2, 1, 64, dtype=torch.float64)}, "key dtype"),
]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("case, change, message", BAD_STORE, ids=[c[0] for c in BAD_STORE])
def test_reshape_and_cache_rejects_the_same_arguments(impl, case, change, message):
    k = kernels(impl)
    args = batch(torch.int8)
    store = dict(key=torch.randn(2, 1, 64), value=torch.randn(2, 1, 64), key_cache=args["key_cache"],
                 value_cache=args["value_cache"], slot_mapping=torch.tensor([0, 1]), k_scale=args["k_scale"],
                 v_scale=args["v_scale"])
    with pytest.raises(AssertionError, match=message):
        k.reshape_and_cache(**{**store, **change})
