#!/usr/bin/env bash
# The test suite: sets up .venv if needed (idempotent), then runs pytest (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python -m pytest "$@"
