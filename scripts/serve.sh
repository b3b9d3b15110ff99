#!/usr/bin/env bash
# Set up (idempotent) and serve the default model on http://127.0.0.1:8000. Extra flags go to `llmpool serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/llmpool serve "$@"
