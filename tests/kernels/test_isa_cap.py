"""PAGEDSERVE_CPU_ISA (kernels/cpu/isa.py, isa.h): under a cap the engine makes the choices a CPU
without the higher instruction sets makes, in Python and in the C++ extension alike. Each cap is
checked in a fresh process (the extension reads the variable once), against what this CPU has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.kernels.cpu import isa

PROBE = """
import json, torch
from pagedserve.core.engine import resolve_dtype
from pagedserve.kernels.cpu import int8_linear, linear
from pagedserve.kernels.cpu.build import load_extension
ext = load_extension()
print(json.dumps({
    "avx512": linear.avx512_available(), "avx2": linear.avx2_fp32_available(), "amx": linear.amx_available(),
    "native_bf16": linear.native_bf16(), "dot": bool(ext.avx512_bf16_dot_native()),
    "bf16_kernels": [k.run for k in linear.runnable_kernels(torch.bfloat16)],
    "fp32_kernel": getattr(linear.prepack_linear(torch.randn(64, 32)), "kernel", None) and
                   linear.prepack_linear(torch.randn(64, 32)).kernel.run,
    "auto_dtype": str(resolve_dtype("auto", torch.device("cpu"))),
    "int8_bf16": int8_linear.kernel_for(torch.bfloat16), "int8_fp32": int8_linear.kernel_for(torch.float32),
    "int8_dot": bool(ext.int8_dot_native()),
}))
"""


def probe(cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != isa.ISA_ENV}
    if cap is not None:
        env[isa.ISA_ENV] = cap
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def uncapped() -> dict:
    return probe(None)


def flags() -> frozenset[str]:
    return isa.cpu_flags() or frozenset()


@pytest.mark.skipif("avx2" not in flags(), reason="an AVX2 cap means nothing on a CPU without AVX2")
def test_avx2_cap_takes_the_choices_of_a_cpu_without_avx512(uncapped):
    got = probe("avx2")
    assert not got["avx512"] and not got["amx"] and not got["native_bf16"] and not got["dot"]
    assert got["avx2"] == uncapped["avx2"]
    assert got["bf16_kernels"] == []  # no AVX-512: bf16 layers keep torch's matmul
    assert got["fp32_kernel"] == ("avx2_fp32_linear" if uncapped["avx2"] else None)
    assert got["auto_dtype"] == "torch.float32"
    # int8 weights: fp32 math on AVX2 for either activation dtype, never the vdpbf16ps kernel.
    avx2_int8 = "int8_avx2_linear" if uncapped["avx2"] else None
    assert got["int8_bf16"] == got["int8_fp32"] == avx2_int8 and not got["int8_dot"]


@pytest.mark.skipif("avx512f" not in flags(), reason="this CPU has no AVX-512")
def test_avx512_cap_takes_the_choices_of_a_cpu_without_bf16_instructions(uncapped):
    got = probe("avx512")
    assert got["avx512"] == uncapped["avx512"] and not got["amx"] and not got["native_bf16"] and not got["dot"]
    assert got["auto_dtype"] == "torch.float32"
    if uncapped["avx512"]:
        assert got["fp32_kernel"] == "fp32_linear"
    assert got["int8_bf16"] == ("int8_avx2_linear" if uncapped["avx2"] else None) and not got["int8_dot"]


@pytest.mark.skipif("avx512_bf16" not in flags(), reason="this CPU has no AVX512-BF16")
def test_avx512_bf16_cap_keeps_bf16_dot_products_and_drops_amx(uncapped):
    got = probe("avx512_bf16")
    assert got["native_bf16"] and got["dot"] and not got["amx"]
    assert got["auto_dtype"] == "torch.bfloat16"
    assert got["int8_bf16"] == "int8_dot_linear" and got["int8_dot"]


def test_no_cap_is_what_the_cpu_has(uncapped):
    f = flags()
    assert uncapped["native_bf16"] == ("avx512_bf16" in f or "amx_bf16" in f)
    assert uncapped["auto_dtype"] == ("torch.bfloat16" if uncapped["native_bf16"] else "torch.float32")
    assert probe("amx") == uncapped  # the highest cap caps nothing


def test_an_unknown_cap_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='avx1024'.*avx2, avx512, avx512_bf16, amx"):
        isa.isa_cap()
    monkeypatch.setenv(isa.ISA_ENV, "AVX2")  # case does not matter
    assert isa.isa_cap() == "avx2" and isa.allowed("avx2") and not isa.allowed("avx512")
