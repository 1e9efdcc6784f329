#!/usr/bin/env bash
# Set everything up, then run the whole test suite (CPU only; exits non-zero on any failure,
# and pytest exits 5 if no test was collected).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test,serve,bench,ray
# loadgroup: the Ray Serve tests share one worker (one local Ray instance, not one per worker)
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
