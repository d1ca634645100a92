#!/usr/bin/env bash
# Set up (if needed) and run the main job: serve the embedded default model (SmolLM2-135M-Instruct)
# on a real Triton Inference Server through pagedserve's Python-backend models (model_repository/).
# Foreground; Ctrl-C stops it. Extra arguments go to `pagedserve triton` (see --help), e.g.
#   bash scripts/run.sh --http-port 9000 --model /path/to/hf-model
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pagedserve triton "$@"
