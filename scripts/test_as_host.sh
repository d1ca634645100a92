#!/usr/bin/env bash
# Run the tests as another kind of x86 host runs them: bash scripts/test_as_host.sh HOST [pytest args]
#   HOST = avx2 (no AVX-512), avx512 (AVX-512 without bf16 instructions), avx512_bf16 (bf16 dot
#          products without AMX). A cap cannot add what the CPU lacks: on an AVX2 machine only avx2
#          means anything.
# The engine's kernel choices follow PAGEDSERVE_CPU_ISA (kernels/cpu/isa.py); torch's own kernels
# follow ATen's, oneDNN's and MKL's caps, set here to the same level. Without pytest args it runs
# the whole suite. scripts/test.sh runs the kernel and model-oracle tests this way for each host.
set -euo pipefail
cd "$(dirname "$0")/.."
host=${1:?usage: bash scripts/test_as_host.sh avx2|avx512|avx512_bf16 [pytest args]}
shift
case "$host" in
  avx2) aten=avx2 onednn=AVX2 mkl=AVX2 ;;
  avx512) aten=avx512 onednn=AVX512_CORE mkl=AVX512 ;;
  avx512_bf16) aten=avx512 onednn=AVX512_CORE_BF16 mkl=AVX512 ;;
  *) echo "unknown host '$host': use avx2, avx512 or avx512_bf16" >&2; exit 2 ;;
esac
bash scripts/setup.sh
PAGEDSERVE_CPU_ISA=$host ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=$onednn MKL_ENABLE_INSTRUCTIONS=$mkl \
  exec .venv/bin/python -m pytest -q "$@"
