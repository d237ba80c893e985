#!/usr/bin/env bash
# The main demo: sets up .venv if needed (idempotent), then trains the same Megatron-Core GPT at CP=1
# (Megatron's attention, 1 process) and CP=4 (ring attention, 4 CPU processes) and prints both loss curves.
# Extra arguments go to examples/cp_demo.py (e.g. --steps 40 --cp-layout striped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python examples/cp_demo.py "$@"
