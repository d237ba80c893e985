#!/usr/bin/env bash
# The main demo: sets up .venv if needed (idempotent), then runs ring attention on 4 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python examples/ring_attention_demo.py "$@"
