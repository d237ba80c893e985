#!/usr/bin/env bash
# Create/refresh a project virtual environment (idempotent, stamped).
#   default flavour: .venv, Python 3.11 (python3), torch==2.13.0 CPU build + megatron-core 0.16.1,
#     pinned by requirements/constraints.txt;
#   MEGATRON_RING_FLAVOR=py312: .venv312, Python 3.12 (pyenv 3.12.1), torch==2.13.0 (the registry's CUDA build,
#     the only cp312 build; it runs on CPU) + megatron-core 0.19.2, pinned by requirements/constraints-py312.txt.
#   torch goes in first and alone; then this package with its extras, every version pinned.
# Usage: scripts/setup_env.sh [extras]   (default extras: test)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-test}"
if [ "${MEGATRON_RING_FLAVOR:-}" = py312 ]; then
  VENV="$(realpath -m "${MEGATRON_RING_VENV312:-.venv312}")"
  CONSTRAINTS=requirements/constraints-py312.txt
  PY="${PYTHON312:-python3.12}"; export PYENV_VERSION="${PYENV_VERSION:-3.12.1}"
  CPU_ONLY=0
else
  VENV="$(realpath -m "${MEGATRON_RING_VENV:-.venv}")"
  CONSTRAINTS=requirements/constraints.txt
  PY="${PYTHON:-python3}"
  CPU_ONLY=1
fi
want="$(cat "$CONSTRAINTS" setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)-$EXTRAS"
stamp="$VENV/.megatron_ring_stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && (cd / && "$VENV/bin/python" -c "import megatron_ring" 2>/dev/null); then
  exit 0
fi
echo "[setup] preparing $VENV (extras: $EXTRAS, constraints: $CONSTRAINTS)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
torch_pin="$(grep -E '^torch==' "$CONSTRAINTS")"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('${torch_pin#torch==}') and ($CPU_ONLY == 0 or not torch.version.cuda) else 1)" 2>/dev/null; then
  # .venv: the CPU wheel is the only build with this exact version here; pip fails rather than fetching CUDA.
  "${PIP[@]}" -c "$CONSTRAINTS" "$torch_pin"
fi
"${PIP[@]}" -c "$CONSTRAINTS" -e ".[$EXTRAS]"
(cd / && "$VENV/bin/python" -c "import torch, megatron_ring; assert $CPU_ONLY == 0 or torch.version.cuda is None, 'a CUDA torch build slipped in'")
echo "$want" > "$stamp"
