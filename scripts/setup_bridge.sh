#!/usr/bin/env bash
# Megatron-Bridge for tests/megatron/test_bridge.py, installed BESIDE the Python 3.12 venv (idempotent, stamped):
#   .bridge312/  <- pip install --no-deps --target, pinned by requirements/bridge-py312.txt
# Used as PYTHONPATH=.bridge312 for that test file only (its pins must not shadow .venv312's packages
# elsewhere). Without dependency resolution on purpose: Bridge's declared dependencies include CUDA-only
# packages and would replace the pinned torch / megatron-core (see the requirements file).
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_RING_FLAVOR=py312 bash scripts/setup_env.sh test
SITE="$(realpath -m "${MEGATRON_RING_BRIDGE_SITE:-.bridge312}")"
REQ=requirements/bridge-py312.txt
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
stamp="$SITE/.megatron_ring_stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "[setup] installing Megatron-Bridge (pinned, --no-deps) into $SITE" >&2
rm -rf "$SITE"  # one pip call into an empty folder: with --target a later call skips existing top-level dirs
.venv312/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --target "$SITE" -r "$REQ"
echo "$want" > "$stamp"
