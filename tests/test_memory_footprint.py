"""What a serving process holds beyond the KV blocks in use: each weight once (in the dtype that
runs; a tied embedding read from the packed LM head where the backend can), no checkpoint left
resident by loading, a bounded oneDNN primitive cache and few malloc arenas (core/models/,
core/layers/onednn_cache.py, core/heap.py). Memory is counted by tensor bytes, malloc's own
counters and the pages of one file's mappings, never by the whole process's RSS, so the checks do
not depend on what else runs on the machine."""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.heap import ARENA_ENV
from pagedserve.core.layers.linear import Linear
from pagedserve.core.layers.onednn_cache import ONEDNN_CACHE_CAPACITY, bound_onednn_caches
from pagedserve.core.sampling_params import SamplingParams

_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _glibc_has(name: str) -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), name)
    except OSError:
        return False


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV and k != ARENA_ENV}
    return subprocess.run([sys.executable, "-c", code, *args], env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=300, check=True)


# -- weights ---------------------------------------------------------------------------------------
def _checkpoint_numel(path: Path) -> int:
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            total += sum(math.prod(sf.get_slice(name).get_shape()) for name in sf.keys())
    return total


def _weight_tensors(model):
    """Every tensor the decoder holds as a weight (not the rotary tables)."""
    yield model.embed
    yield model.norm
    linears = list(model.lm_head)
    for layer in model.layers:
        for f in fields(layer):
            value = getattr(layer, f.name)
            if isinstance(value, Linear):
                linears.append(value)
            else:
                yield value
    for linear in linears:
        yield from (linear.weight, linear.bias, linear.packed, getattr(linear.kernel, "packed", None))


def _copies(linear: Linear) -> int:
    return sum(x is not None for x in (linear.weight, linear.packed, linear.kernel))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # each has its packed kernel
@pytest.mark.parametrize("family", ["llama", "llama3"])  # untied and tied embeddings
def test_a_model_holds_each_weight_once(tiny_model_dir, family, dtype):
    path = tiny_model_dir(family)
    settings = {"model": str(path), "dtype": str(dtype).removeprefix("torch."), "device": "cpu"}
    engine = LLMEngine(EngineConfig.from_dict(settings))
    model = engine.runner.model
    tensors = [t for t in _weight_tensors(model) if t is not None]
    # No load buffer of another precision survives loading, rotary tables included.
    assert {t.dtype for t in tensors} | {model.rotary.cos.dtype, model.rotary.sin.dtype} == {dtype}
    storages, held = set(), 0
    for t in tensors:
        if t.is_mkldnn:  # oneDNN's blocked copy: opaque storage, its own bytes
            held += t.numel() * t.element_size()
        elif t.untyped_storage().data_ptr() not in storages:
            storages.add(t.untyped_storage().data_ptr())
            held += t.untyped_storage().nbytes()
    # Each Linear keeps its plain weight, oneDNN's packed copy or the backend's, never two.
    for linear in [*model.lm_head, *(getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down"))]:
        assert _copies(linear) == 1
    size = dtype.itemsize
    expected = _checkpoint_numel(path) * size
    tied = engine.arch.tie_word_embeddings
    assert (model.embed is None) == (tied and model.embed_rows is not None)
    if tied and model.embed is not None and model.lm_head[0].weight is None:
        # Packed by oneDNN (an opaque layout), a tied LM head cannot serve the lookup: the one
        # deliberate second copy, kept because the packed head runs 1.4-1.6x faster.
        expected += model.embed.numel() * size
    assert held == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_embedding_read_from_the_packed_head_embeds_the_same(tiny_model_dir, monkeypatch, dtype):
    """Where the backend can read rows back from its packed LM head, the tied embedding is looked
    up there (no plain copy); every logit is then what the plain lookup gives."""
    import pagedserve.kernels.cpu as cpu_kernels

    settings = {"model": str(tiny_model_dir("llama3")), "dtype": dtype, "device": "cpu"}
    packed = LLMEngine(EngineConfig.from_dict(settings))
    if packed.runner.model.embed_rows is None:
        pytest.skip(f"the backend packed no {dtype} LM head it can read rows from here (bf16: no AMX; fp32: no AVX-512)")
    prepack = cpu_kernels.prepack_linear

    def without_rows(weight):
        kernel = prepack(weight)
        if kernel is not None:
            del kernel.rows
        return kernel

    monkeypatch.setattr(cpu_kernels, "prepack_linear", without_rows)  # the backend the decoder asks
    plain = LLMEngine(EngineConfig.from_dict(settings))
    assert plain.runner.model.embed_rows is None and plain.runner.model.embed is not None
    prompts = [[5, 17, 300, 42, 7] * 9, list(range(1, 383, 3)), [383, 0, 1]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    got, want = packed.generate(prompts, params), plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs and g.prompt_logprobs == w.prompt_logprobs  # bit for bit


_LOAD_WATCHED = r"""
import json
from pathlib import Path
from pagedserve.core.models import loader
from pagedserve.core.models.default_model import resolve_model_path
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine

shard = str(next(Path(resolve_model_path("default")).glob("*.safetensors")).resolve())

def resident_from_shard():
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                inside = len(head) > 5 and head[5].strip() == shard
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total

get, peak, largest = loader._Checkpoint.get, [0], [0]
def watched(self, name, *dtype):
    tensor = get(self, name, *dtype)
    largest[0] = max(largest[0], tensor.numel() * 4)
    peak[0] = max(peak[0], resident_from_shard())
    return tensor
loader._Checkpoint.get = watched
engine = LLMEngine(EngineConfig.from_dict({"model": "default", "dtype": "bfloat16", "device": "cpu"}))
print(json.dumps({"peak": peak[0], "largest": largest[0], "after": resident_from_shard(),
                  "size": Path(shard).stat().st_size, "dtype": str(engine.dtype)}))
"""


def test_converting_the_checkpoint_does_not_keep_it_resident():
    """SmolLM2's fp32 checkpoint loaded in bf16: the fp32 pages read leave as loading goes on
    (at most CONVERT_HANDLE_BYTES and the tensor being read stay mapped), instead of the whole file
    staying resident beside the converted weights until the load ends."""
    from pagedserve.core.models.loader import CONVERT_HANDLE_BYTES

    got = json.loads(_run(_LOAD_WATCHED).stdout.splitlines()[-1])
    assert got["size"] > 400 << 20 and got["dtype"] == "torch.bfloat16"
    assert got["peak"] <= CONVERT_HANDLE_BYTES + 2 * got["largest"], got
    assert got["after"] == 0, got


# -- oneDNN's primitive caches ------------------------------------------------------------------------
def test_the_bound_is_a_default_the_operator_can_override(monkeypatch):
    for name in _CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
                                     "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "500")  # oneDNN's older spelling counts too
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert bound_onednn_caches() == {"DNNL_PRIMITIVE_CACHE_CAPACITY": "500", "LRU_CACHE_CAPACITY": "7"}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ


_MANY_ROW_COUNTS = r"""
import ctypes, json, os, sys
import torch
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.layers.linear import Linear

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

LLMEngine(EngineConfig.from_dict({"model": sys.argv[1], "dtype": "bfloat16", "device": "cpu"}))
layer = Linear(torch.randn(512, 256).to(torch.bfloat16))
layer(torch.randn(1, 256).to(torch.bfloat16))
before = in_use()
for rows in range(2, 130):  # a serving batch's row count changes whenever a request joins or leaves
    layer(torch.randn(rows, 256).to(torch.bfloat16))
print(json.dumps({"grown": in_use() - before, "packed": layer.packed is not None,
                  "env": {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}}))
"""


@pytest.mark.skipif(not _glibc_has("mallinfo2"), reason="needs glibc's mallinfo2 (glibc 2.33+) to count heap bytes")
def test_the_engine_bounds_what_onednn_keeps_per_row_count(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    bounded = json.loads(_run(_MANY_ROW_COUNTS, path).stdout.splitlines()[-1])
    if not bounded["packed"]:
        pytest.skip("this torch build has no oneDNN bf16 packing: no oneDNN primitives to bound")
    assert bounded["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
                              "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}
    # torch's own defaults, set by an operator (whose setting wins): the unbounded growth.
    unbounded = json.loads(_run(_MANY_ROW_COUNTS, path, env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
                                                             "LRU_CACHE_CAPACITY": "1024"}).stdout.splitlines()[-1])
    assert unbounded["env"]["LRU_CACHE_CAPACITY"] == "1024"
    if unbounded["grown"] < 128 * 64 * 1024:
        pytest.skip(f"this oneDNN keeps little per GEMM shape ({unbounded['grown']} bytes for 128 shapes)")
    # 128 row counts: the bound keeps 32 primitives of them, the default all 128.
    assert bounded["grown"] < unbounded["grown"] / 2.5, (bounded, unbounded)


# -- malloc arenas ------------------------------------------------------------------------------------
_THREADS_ALLOCATE = r"""
import ctypes, sys, threading
from pagedserve.core.heap import limit_malloc_arenas
applied = limit_malloc_arenas() if sys.argv[1] == "limit" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
all_started = threading.Barrier(7)
def work():  # six threads alive at once, each allocating: glibc hands each a new arena up to its limit
    p = libc.malloc(1 << 16)
    all_started.wait()
    libc.free(p)
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
all_started.wait()
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
for t in threads:
    t.join()
print(applied)
"""


@pytest.mark.skipif(not _glibc_has("malloc_stats"), reason="arena limits are glibc's")
def test_engine_threads_share_two_malloc_arenas():
    def arenas(mode: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        done = _run(_THREADS_ALLOCATE, mode, env=env)
        return sum(line.startswith("Arena ") for line in done.stderr.splitlines()), done.stdout.strip()

    assert arenas("limit") == (2, "True")
    assert arenas("none")[0] >= 4  # glibc's default: a new arena per thread, up to 8 per core
    assert arenas("limit", env={ARENA_ENV: "3"}) == (3, "False")  # the operator's MALLOC_ARENA_MAX wins
