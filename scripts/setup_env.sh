#!/usr/bin/env bash
# Create/refresh a project virtual environment (idempotent, stamped).
#   default flavour: .venv, Python 3.11 (python3), torch==2.13.0 + megatron-core 0.16.1, pinned by
#     requirements/constraints.txt. Either build of torch 2.13.0 is accepted: the CPU build where the package
#     index serves it (preferred on machines without an NVIDIA GPU), else the CUDA build an ordinary index
#     serves for Python 3.11 (it runs on CPU too; on a machine with NVIDIA GPUs it also runs tests/gpu);
#   MEGATRON_RING_FLAVOR=py312: .venv312, Python 3.12 (pyenv 3.12.1), torch==2.13.0 (the registry's CUDA build,
#     the only cp312 build; it runs on CPU) + megatron-core 0.19.2, pinned by requirements/constraints-py312.txt.
#   torch goes in first and alone; then this package with its extras, every version pinned; then the lab
#   (lab/pyproject.toml, editable, no dependencies of its own beyond the test extra's).
#   MEGATRON_RING_FLAVOR=floor: .venv-floor, Python 3.11, the OLDEST torch the package declares (setup.cfg;
#     requirements/constraints-floor.txt: torch==2.11.0, the build the index serves) + megatron-core 0.16.1.
# Usage: scripts/setup_env.sh [extras]   (default extras: test)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-test}"
if [ "${MEGATRON_RING_FLAVOR:-}" = floor ]; then
  VENV="$(realpath -m "${MEGATRON_RING_VENV_FLOOR:-.venv-floor}")"
  CONSTRAINTS=requirements/constraints-floor.txt
  PY="${PYTHON:-python3}"
elif [ "${MEGATRON_RING_FLAVOR:-}" = py312 ]; then
  VENV="$(realpath -m "${MEGATRON_RING_VENV312:-.venv312}")"
  CONSTRAINTS=requirements/constraints-py312.txt
  PY="${PYTHON312:-python3.12}"; export PYENV_VERSION="${PYENV_VERSION:-3.12.1}"
else
  VENV="$(realpath -m "${MEGATRON_RING_VENV:-.venv}")"
  CONSTRAINTS=requirements/constraints.txt
  PY="${PYTHON:-python3}"
fi
want="$(cat "$CONSTRAINTS" setup.cfg pyproject.toml lab/pyproject.toml | sha256sum | cut -d' ' -f1)-$EXTRAS"
stamp="$VENV/.megatron_ring_stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && (cd / && "$VENV/bin/python" -c "import megatron_ring, megatron_ring_lab" 2>/dev/null); then
  exit 0
fi
echo "[setup] preparing $VENV (extras: $EXTRAS, constraints: $CONSTRAINTS)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
torch_pin="$(grep -E '^torch==' "$CONSTRAINTS")"
have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then have_gpu=1; fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${torch_pin#torch==}' else 1)" 2>/dev/null; then
  # The version is pinned; the build is whatever the index serves for it. Without a GPU the CPU build is
  # preferred: try the exact local version first (where the index has it), then the plain pin.
  if [ "$have_gpu" = 1 ] || ! "${PIP[@]}" "${torch_pin}+cpu" 2>/dev/null; then
    "${PIP[@]}" -c "$CONSTRAINTS" "$torch_pin"
  fi
fi
"${PIP[@]}" -c "$CONSTRAINTS" -e ".[$EXTRAS]"
"${PIP[@]}" -c "$CONSTRAINTS" --no-deps -e ./lab   # the lab (CPU harness, doctor, benchmark): its own distribution
(cd / && "$VENV/bin/python" -c "
import torch, megatron_ring, megatron_ring_lab
assert torch.__version__.split('+')[0] == '${torch_pin#torch==}', f'torch {torch.__version__} is not the pinned ${torch_pin}'
build = f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU'
gpu = torch.cuda.is_available()
print(f'[setup] torch {torch.__version__} ({build} build); CUDA GPU usable: {gpu}')
if $have_gpu and not gpu:
    print('[setup] note: this machine has NVIDIA GPUs but torch cannot use them: tests/gpu will be skipped')
")
echo "$want" > "$stamp"
