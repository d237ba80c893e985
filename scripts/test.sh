#!/usr/bin/env bash
# The test suite on both ends of the supported megatron-core range (extra args go to pytest):
#   0. the fast tier first: .venv, pytest -m "not slow" "$@" (single-process tests; under 2 minutes), then the
#      same fast tier on .venv-floor (the oldest torch setup.cfg declares, torch 2.11; skip with
#      MEGATRON_RING_SKIP_FLOOR=1), then
#      the fast numerics under every CPU instruction set (scripts/numerics_matrix.sh --fast; skip with
#      MEGATRON_RING_SKIP_NUMERICS_MATRIX=1);
#   1. .venv    (Python 3.11, megatron-core 0.16.1): the rest, pytest -m slow "$@" (default: tests/);
#   2. .venv312 (Python 3.12, megatron-core 0.19.2, ships megatron.training; its torch is a CUDA build that runs
#      on CPU): tests/megatron, which includes the real-loop tests (Megatron's own pretrain()), and
#      tests/fake_cuda, the fake-CUDA tier (the GPU path traced under FakeTensorMode, fast); only the options
#      of "$@" pass; tests/megatron/test_mamba_v016.py there runs megatron-core 0.16.1's MambaModel from .venv's
#      wheel in a child process (0.16.1's Mamba mixer imports triton, which .venv lacks);
#   3. .venv312 + Megatron-Bridge (.bridge312, pinned, scripts/setup_bridge.sh): tests/megatron/test_bridge.py and
#      tests/megatron/test_bridge_hybrid.py.
# On a machine with NVIDIA GPUs (and a CUDA build of torch in .venv) step 1 also runs tests/gpu (part of
# tests/; skipped with a reason elsewhere); scripts/gpu_check.sh is the GPU users' one command.
# Both venvs are set up if needed (idempotent). MEGATRON_RING_SKIP_PY312=1 runs step 1 only;
# MEGATRON_RING_SKIP_BRIDGE=1 skips step 3.
# pytest's exit code 5 ("no tests collected", e.g. a -k that selects nothing in one venv) is not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
run_pytest() {  # venv, args...
  local py="$1/bin/python"; shift
  "$py" -m pytest "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && { echo "[test] $py: no tests collected (ok)"; rc=0; }
  return "$rc"
}
bash scripts/setup_env.sh test || exit $?
.venv/bin/python -c 'import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"[test] {n} CUDA GPU(s): tests/gpu " + ("runs" if n else "is skipped (no usable GPU)"))' || true
t0=$(date +%s)
run_pytest .venv -m "not slow" "$@"; rcfast=$?
echo "[test] fast tier (-m 'not slow'): rc=$rcfast in $(( $(date +%s) - t0 )) s"
rcfloor=0
if [ "${MEGATRON_RING_SKIP_FLOOR:-0}" != 1 ]; then  # the declared torch floor (setup.cfg): the fast tier on it
  MEGATRON_RING_FLAVOR=floor bash scripts/setup_env.sh test || exit $?
  echo "[test] torch floor: $(.venv-floor/bin/python -c 'import torch; print(torch.__version__)'), fast tier"
  run_pytest .venv-floor -m "not slow" -q -p no:cacheprovider; rcfloor=$?
fi
rcnum=0
if [ "${MEGATRON_RING_SKIP_NUMERICS_MATRIX:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/numerics_matrix.sh --fast; rcnum=$?
fi
run_pytest .venv -m slow "$@"; rc311=$?
[ "$rcfast" -eq 0 ] || rc311=$rcfast
rc312=0
if [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ]; then
  MEGATRON_RING_FLAVOR=py312 bash scripts/setup_env.sh test || exit $?
  opts=(); for a in "$@"; do [[ "$a" == -* ]] && opts+=("$a"); done
  echo "[test] megatron-core $(.venv312/bin/python -c 'from megatron.core import package_info as p; print(p.__version__)' 2>/dev/null), Python 3.12: tests/megatron tests/fake_cuda"
  run_pytest .venv312 "${opts[@]}" tests/megatron tests/fake_cuda --ignore=tests/megatron/test_bridge.py \
    --ignore=tests/megatron/test_bridge_hybrid.py; rc312=$?
fi
rcbridge=0
if [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ] && [ "${MEGATRON_RING_SKIP_BRIDGE:-0}" != 1 ]; then
  bash scripts/setup_bridge.sh || exit $?
  echo "[test] Megatron-Bridge $(PYTHONPATH=.bridge312 .venv312/bin/python -c 'import importlib.metadata as m; print(m.version("megatron-bridge"))'), Python 3.12: tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py"
  PYTHONPATH="$PWD/.bridge312${PYTHONPATH:+:$PYTHONPATH}" run_pytest .venv312 "${opts[@]}" tests/megatron/test_bridge.py \
    tests/megatron/test_bridge_hybrid.py
  rcbridge=$?
fi
echo "[test] fast tier: rc=$rcfast; torch floor: rc=$rcfloor; numerics under every instruction set: rc=$rcnum; Python 3.11 / megatron-core 0.16.1: rc=$rc311; Python 3.12 / megatron-core 0.19.2: rc=$rc312; Megatron-Bridge: rc=$rcbridge"
[ "$rc311" -eq 0 ] && [ "$rcfloor" -eq 0 ] && [ "$rcnum" -eq 0 ] && [ "$rc312" -eq 0 ] && [ "$rcbridge" -eq 0 ]
