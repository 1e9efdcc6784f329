#!/usr/bin/env bash
# Set everything up, then run speculative generation on the default models (SmolLM2-135M + draft).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/specdec generate --chat \
  --prompt "Write a Python function that returns the n-th Fibonacci number." "$@"
