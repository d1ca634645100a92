#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pagedserve generate "$@"
