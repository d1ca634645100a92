#!/usr/bin/env bash
# GPU checks for the Triton kernels and KV-cache quantization: one script, under 8 minutes on a
# single H100/H200. A CPU-only machine skips it (exit 0); there the kernels are tested under
# TRITON_INTERPRET=1 by the ordinary test suite.
#
#   bash bench/gpu_check.sh            (from anywhere; needs torch with CUDA, triton, the default model)
#
# 1. the kernel tests on the GPU, full grid (tests/kernels, PAGEDSERVE_FULL_KERNEL_TESTS=1)
# 2. decode-attention microbenchmark: achieved GB/s against the device's peak
# 3. throughput benchmark, bf16 model, the bf16 KV cache vs each quantized KV dtype
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here; skipped (CPU machines test the kernels under TRITON_INTERPRET=1)"
    exit 0
fi
"$PY" -c 'import triton' || { echo "gpu_check: triton is not installed (pip install -e '.[gpu]')"; exit 1; }
unset TRITON_INTERPRET
export PAGEDSERVE_FULL_KERNEL_TESTS=1
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'
start=$SECONDS

echo "== 1/3 kernel tests on the GPU (budget 180 s)"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/kernels

echo "== 2/3 decode attention microbenchmark (budget 90 s)"
timeout 90 "$PY" -m bench.kvquant --decode-microbench

echo "== 3/3 throughput: bf16 model, each KV cache dtype in one budget (budget 180 s)"
timeout 180 "$PY" -m bench.kvquant --dtype bfloat16 --kv-dtypes bf16,int8,fp8_e4m3,fp8_e5m2,fp16

echo "gpu_check: done in $((SECONDS - start)) s"
