"""Which x86 instruction sets the CPU kernels may use: what the CPU has, capped by the environment
variable ``PAGEDSERVE_CPU_ISA``.

``PAGEDSERVE_CPU_ISA`` is one of ``avx2``, ``avx512``, ``avx512_bf16``, ``amx`` (each includes the
ones before it); unset or empty means no cap. Under a cap the engine makes every choice a CPU
without the higher sets makes: the kernel each linear layer takes, the attention and sampling
kernels' builds (kernels/cpu/isa.h applies the same cap in C++), and whether bf16 counts as native
(``dtype: auto``). Uses: run on one machine what another kind of host runs (the suite does, to keep
main green on hosts its authors lack: docs/engine.md), or rule a kernel out when it is suspected of
a fault. To make torch's own kernels follow suit set their variables too (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``; scripts/test_as_host.sh sets all four).

Imports nothing heavy: the build script and the engine's dtype choice read it before torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ISA_ENV = "PAGEDSERVE_CPU_ISA"
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
"""The caps, lowest first; a cap allows its own level and the ones before it."""


def isa_cap() -> str | None:
    """The cap set in the environment (None: none); an unknown value is refused naming the choices."""
    value = os.environ.get(ISA_ENV, "").lower()
    if not value:
        return None
    if value not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not an instruction-set cap; use one of "
                         f"{', '.join(ISA_LEVELS)}, or unset it to use everything the CPU has")
    return value


def allowed(level: str) -> bool:
    """Whether the cap (if any) lets the kernels use `level` (one of ISA_LEVELS)."""
    cap = isa_cap()
    return cap is None or ISA_LEVELS.index(level) <= ISA_LEVELS.index(cap)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    """Whether bf16 dot products run natively here and the cap allows them: AVX512-BF16
    (vdpbf16ps) or AMX. Where they do, bf16 matmuls (oneDNN's, ours) beat fp32 and ``dtype: auto``
    is bf16; without them bf16 is emulated, several times slower than fp32."""
    flags = cpu_flags()
    if flags is None:  # not Linux: ask torch, which has no cap to apply
        import torch

        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return ("avx512_bf16" in flags and allowed("avx512_bf16")) or ("amx_bf16" in flags and allowed("amx"))
