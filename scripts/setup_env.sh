#!/usr/bin/env bash
# Create/refresh the project virtual environment (idempotent).
#   torch==2.13.0 (CPU build) goes in first and alone, so nothing can pull CUDA wheels;
#   then this package with its extras, every version pinned by requirements/constraints.txt.
# Usage: scripts/setup_env.sh [extras]   (default extras: test)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(realpath -m "${MEGATRON_RING_VENV:-.venv}")"
EXTRAS="${1:-test}"
PY="${PYTHON:-python3}"
want="$(cat requirements/constraints.txt setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)-$EXTRAS"
stamp="$VENV/.megatron_ring_stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && (cd / && "$VENV/bin/python" -c "import megatron_ring" 2>/dev/null); then
  exit 0
fi
echo "[setup] preparing $VENV (extras: $EXTRAS)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
torch_pin="$(grep -E '^torch==' requirements/constraints.txt)"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('${torch_pin#torch==}') and not torch.version.cuda else 1)" 2>/dev/null; then
  # The CPU wheel is the only build with this exact version here; pip fails rather than fetching CUDA.
  "${PIP[@]}" "$torch_pin"
fi
"${PIP[@]}" -c requirements/constraints.txt -e ".[$EXTRAS]"
(cd / && "$VENV/bin/python" -c "import torch, megatron_ring; assert torch.version.cuda is None, 'a CUDA torch build slipped in'")
echo "$want" > "$stamp"
