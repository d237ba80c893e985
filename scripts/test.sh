#!/usr/bin/env bash
# The test suite on both ends of the supported megatron-core range (extra args go to pytest):
#   0. the fast tier first: .venv, pytest -m "not slow" "$@" (single-process tests; about a minute), then
#      the fast numerics under every CPU instruction set (scripts/numerics_matrix.sh --fast; skip with
#      MEGATRON_RING_SKIP_NUMERICS_MATRIX=1);
#   1. .venv    (Python 3.11, megatron-core 0.16.1): the rest, pytest -m slow "$@" (default: tests/);
#   2. .venv-floor: the fast tier on the OLDEST torch setup.cfg declares (torch 2.11; skip with
#      MEGATRON_RING_SKIP_FLOOR=1);
#   3. .venv312 (Python 3.12, megatron-core 0.19.2, ships megatron.training; its torch is a CUDA build that runs
#      on CPU): tests/megatron, which includes the real-loop tests (Megatron's own pretrain()), and
#      tests/fake_cuda, the fake-CUDA tier (the GPU path traced under FakeTensorMode, fast); only the options
#      of "$@" pass; tests/megatron/test_mamba_v016.py there runs megatron-core 0.16.1's MambaModel from .venv's
#      wheel in a child process (0.16.1's Mamba mixer imports triton, which .venv lacks);
#   4. .venv312 + Megatron-Bridge (.bridge312, pinned, scripts/setup_bridge.sh): tests/megatron/test_bridge.py and
#      tests/megatron/test_bridge_hybrid.py.
# Each pytest run is two parts: the tests not marked `serial` on MEGATRON_RING_TEST_WORKERS pytest-xdist
# workers (default: 2, or 1 on a one-core machine; a file's tests on one worker), then the `serial` ones alone
# (tests/conftest.py SERIAL: wall-clock bounds, network namespaces, the GPU; none in steps 3 and 4, which run in
# one part). The .venv-floor and .venv312 / Bridge set-ups (downloads) run
# in the background while .venv's fast tier, numerics and non-serial slow tests run; the serial tests wait for
# them to end.
# On a machine with NVIDIA GPUs (and a CUDA build of torch in .venv) step 1 also runs tests/gpu (part of
# tests/; skipped with a reason elsewhere; serial); scripts/gpu_check.sh is the GPU users' one command.
# Every venv is set up if needed (idempotent). MEGATRON_RING_SKIP_PY312=1 skips steps 3 and 4;
# MEGATRON_RING_SKIP_BRIDGE=1 skips step 4.
# pytest's exit code 5 ("no tests collected", e.g. a -k that selects nothing in one part) is not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKERS="${MEGATRON_RING_TEST_WORKERS:-$( [ "$(env -u OMP_NUM_THREADS nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 1)}"
run_pytest() {  # venv, args...
  local py="$1/bin/python"; shift
  "$py" -m pytest "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && { echo "[test] $py: no tests collected (ok)"; rc=0; }
  return "$rc"
}
PAR=(); [ "$WORKERS" -gt 1 ] && PAR=(-n "$WORKERS" --dist loadfile)  # a file's tests (and its module fixtures) on one worker
run_split() {  # venv, marker expression, args...: the non-serial tests on WORKERS workers, then the serial ones alone
  local venv="$1" mark="$2"; shift 2
  local rc1 rc2
  run_pytest "$venv" -m "($mark) and not serial" "${PAR[@]}" "$@"; rc1=$?
  run_pytest "$venv" -m "($mark) and serial" "$@"; rc2=$?
  [ "$rc1" -eq 0 ] && return "$rc2"; return "$rc1"
}
bash scripts/setup_env.sh test || exit $?
.venv/bin/python -c 'import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"[test] {n} CUDA GPU(s): tests/gpu " + ("runs" if n else "is skipped (no usable GPU)"))' || true

# the other venvs' set-ups, in the background (logs shown when they end)
bglog=$(mktemp -d); trap 'rm -rf "$bglog"' EXIT
pids=()
if [ "${MEGATRON_RING_SKIP_FLOOR:-0}" != 1 ]; then
  (MEGATRON_RING_FLAVOR=floor bash scripts/setup_env.sh test) > "$bglog/floor" 2>&1 & pids+=("floor:$!")
fi
if [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ]; then
  (MEGATRON_RING_FLAVOR=py312 bash scripts/setup_env.sh test && if [ "${MEGATRON_RING_SKIP_BRIDGE:-0}" != 1 ]; then
     bash scripts/setup_bridge.sh; fi) > "$bglog/py312" 2>&1 & pids+=("py312:$!")
fi
wait_setups() {
  local p rc=0 r
  for p in "${pids[@]}"; do
    wait "${p#*:}"; r=$?
    sed "s/^/[setup ${p%%:*}] /" "$bglog/${p%%:*}"
    [ "$r" -eq 0 ] || { echo "[test] the ${p%%:*} set-up failed (rc=$r)"; rc=$r; }
  done
  pids=(); return "$rc"
}

t0=$(date +%s)
run_pytest .venv -m "not slow and not serial" "${PAR[@]}" "$@"; rcfast=$?
echo "[test] fast tier (-m 'not slow', not serial): rc=$rcfast in $(( $(date +%s) - t0 )) s"
rcnum=0
if [ "${MEGATRON_RING_SKIP_NUMERICS_MATRIX:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/numerics_matrix.sh --fast; rcnum=$?
fi
t0=$(date +%s)
run_pytest .venv -m "slow and not serial" "${PAR[@]}" "$@"; rc311=$?
echo "[test] Python 3.11 slow tier, not serial: rc=$rc311 in $(( $(date +%s) - t0 )) s"
wait_setups || exit $?
t0=$(date +%s)
run_pytest .venv -m serial "$@"; rcser=$?
echo "[test] Python 3.11 serial tests (fast and slow): rc=$rcser in $(( $(date +%s) - t0 )) s"
[ "$rc311" -eq 0 ] || rcser=$rc311
[ "$rcfast" -eq 0 ] || rcser=$rcfast
rc311=$rcser
rcfloor=0
if [ "${MEGATRON_RING_SKIP_FLOOR:-0}" != 1 ]; then  # the declared torch floor (setup.cfg): the fast tier on it
  echo "[test] torch floor: $(.venv-floor/bin/python -c 'import torch; print(torch.__version__)'), fast tier"
  run_split .venv-floor "not slow" -q -p no:cacheprovider; rcfloor=$?
fi
rc312=0
opts=(); for a in "$@"; do [[ "$a" == -* ]] && opts+=("$a"); done
if [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ]; then
  echo "[test] megatron-core $(.venv312/bin/python -c 'from megatron.core import package_info as p; print(p.__version__)' 2>/dev/null), Python 3.12: tests/megatron tests/fake_cuda"
  t0=$(date +%s)
  # no serial tests live in tests/megatron or tests/fake_cuda (tests/conftest.py fails one that reaches a worker)
  run_pytest .venv312 "${PAR[@]}" "${opts[@]}" tests/megatron tests/fake_cuda --ignore=tests/megatron/test_bridge.py \
    --ignore=tests/megatron/test_bridge_hybrid.py; rc312=$?
  echo "[test] Python 3.12 tier: rc=$rc312 in $(( $(date +%s) - t0 )) s"
fi
rcbridge=0
if [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ] && [ "${MEGATRON_RING_SKIP_BRIDGE:-0}" != 1 ]; then
  echo "[test] Megatron-Bridge $(PYTHONPATH=.bridge312 .venv312/bin/python -c 'import importlib.metadata as m; print(m.version("megatron-bridge"))'), Python 3.12: tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py"
  PYTHONPATH="$PWD/.bridge312${PYTHONPATH:+:$PYTHONPATH}" run_pytest .venv312 "${PAR[@]}" "${opts[@]}" \
    tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py
  rcbridge=$?
fi
echo "[test] fast tier: rc=$rcfast; torch floor: rc=$rcfloor; numerics under every instruction set: rc=$rcnum; Python 3.11 / megatron-core 0.16.1: rc=$rc311; Python 3.12 / megatron-core 0.19.2: rc=$rc312; Megatron-Bridge: rc=$rcbridge"
[ "$rc311" -eq 0 ] && [ "$rcfloor" -eq 0 ] && [ "$rcnum" -eq 0 ] && [ "$rc312" -eq 0 ] && [ "$rcbridge" -eq 0 ]
