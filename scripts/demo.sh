#!/usr/bin/env bash
# The main demo: Megatron-LM's own training loop (megatron.training.pretrain, shipped with megatron-core 0.19)
# trains the same GPT at CP=1 (Megatron's attention, 1 process) and CP=4 (ring attention, 4 CPU processes);
# Megatron's per-iteration progress is shown as it prints it, then both loss curves side by side.
# Sets up .venv312 if needed (idempotent). Extra arguments go to examples/pretrain_demo.py (e.g. --iters 40
# --cp-layout striped). The older hand-written-loop demo: .venv/bin/python examples/cp_demo.py
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_RING_FLAVOR=py312 bash scripts/setup_env.sh test
exec .venv312/bin/python examples/pretrain_demo.py "$@"
