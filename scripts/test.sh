#!/usr/bin/env bash
# The test suite on both ends of the supported megatron-core range (extra args go to pytest):
#   0. the fast tier first: .venv, pytest -m "not slow" "$@" (single-process tests; about a minute), then
#      the fast numerics under every other CPU instruction set (scripts/numerics_matrix.sh --fast --native-report:
#      the fast tier ran torch's own choice and its report stands for it; skip with
#      MEGATRON_RING_SKIP_NUMERICS_MATRIX=1);
#   1. .venv    (Python 3.11, megatron-core 0.16.1): the rest, pytest -m slow "$@" (default: tests/), then the
#      serial tests alone;
#   2. .venv-floor: the fast tier on the OLDEST torch setup.cfg declares, less three fake-CUDA budget files
#      (FLOOR_SKIP below) (torch 2.11; skip with
#      MEGATRON_RING_SKIP_FLOOR=1);
#   3. .venv312 (Python 3.12, megatron-core 0.19.2, ships megatron.training; its torch is a CUDA build that runs
#      on CPU): tests/megatron, which includes the real-loop tests (Megatron's own pretrain()), and
#      tests/fake_cuda, the fake-CUDA tier (the GPU path traced under FakeTensorMode, fast); only the options
#      of "$@" pass; tests/megatron/test_mamba_v016.py there runs megatron-core 0.16.1's MambaModel from .venv's
#      wheel in a child process (0.16.1's Mamba mixer imports triton, which .venv lacks);
#   4. .venv312 + Megatron-Bridge (.bridge312, pinned, scripts/setup_bridge.sh): tests/megatron/test_bridge.py and
#      tests/megatron/test_bridge_hybrid.py.
# Steps 0, 1 and 3 run on MEGATRON_RING_TEST_WORKERS pytest-xdist workers (default: 2, or 1 on a one-core machine; a
# file's tests on one worker). In the background from the start, at the lowest CPU priority (nice 19: mostly the
# cycles the steps in the foreground leave idle; the latency-bound serial tests still run slower beside them, within
# their bounds): the .venv-floor set-up and then step 2's non-serial tests in ONE pytest process, and the .venv312 / Bridge
# set-ups (downloads); step 3 waits for the latter, and step 4 runs in one background pytest process beside step 3
# (multi-process Megatron jobs whose ranks wait on each other leave the cores idle part of the time). Background
# output is printed when it is waited for. The `serial` tests (tests/conftest.py SERIAL: wall-clock bounds, network
# namespaces, the GPU; none in steps 3 and 4) run alone in the foreground: step 1's after its slow tier, step 2's
# after everything else.
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
opts=(); for a in "$@"; do [[ "$a" == -* ]] && opts+=("$a"); done
floor=0; [ "${MEGATRON_RING_SKIP_FLOOR:-0}" != 1 ] && floor=1  # the declared torch floor (setup.cfg): its fast tier
py312=0; [ "${MEGATRON_RING_SKIP_PY312:-0}" != 1 ] && py312=1
bridge=0; [ "$py312" = 1 ] && [ "${MEGATRON_RING_SKIP_BRIDGE:-0}" != 1 ] && bridge=1
lowest() { renice -n 19 -p "$BASHPID" > /dev/null 2>&1 || true; }  # this subshell and its children: nice 19
# The floor leaves out three fake-CUDA files that hold this library's own budgets on the traced CUDA path (the largest
# tensor, the device ops per call, the host transfers): the Python 3.12 tier checks them on the pinned torch; what
# depends on torch's release there (its private ops' calls, the meta kernels, Triton) the floor's other fake-CUDA
# files check (~85 s of CPU saved on a saturated 2-core machine)
FLOOR_SKIP=(--ignore=tests/fake_cuda/test_fallback_memory.py --ignore=tests/fake_cuda/test_op_count.py
            --ignore=tests/fake_cuda/test_host_transfers.py)
run_floor_fast() {
  echo "[test] torch floor: $(.venv-floor/bin/python -c 'import torch; print(torch.__version__)'), fast tier (not serial)"
  run_pytest .venv-floor -m "not slow and not serial" -q -p no:cacheprovider "${FLOOR_SKIP[@]}"
}
run_bridge() {
  echo "[test] Megatron-Bridge $(PYTHONPATH=.bridge312 .venv312/bin/python -c 'import importlib.metadata as m; print(m.version("megatron-bridge"))'), Python 3.12: tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py"
  # its workers fork from a server that imported Bridge once (tests/megatron/bridge_preload.py)
  MEGATRON_RING_TEST_PRELOAD_BRIDGE=1 PYTHONPATH="$PWD/.bridge312${PYTHONPATH:+:$PYTHONPATH}" run_pytest .venv312 "${opts[@]}" \
    tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py
}
# Disk: the venvs still to set up need room (measured on x86_64: .venv 1.1 GiB, .venv-floor 4.8 and .venv312 4.9, each
# a CUDA build of torch from PyPI, .bridge312 0.7; pip unpacks each wheel beside it): say so up front, naming the tiers
# that can be skipped, rather than fail with "No space left on device" minutes in
need=0
[ -d .venv ] || need=$((need + 2))
[ "$floor" = 1 ] && [ ! -d .venv-floor ] && need=$((need + 6))
[ "$py312" = 1 ] && [ ! -d .venv312 ] && need=$((need + 6))
[ "$bridge" = 1 ] && [ ! -d .bridge312 ] && need=$((need + 1))
free=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }')
echo "[test] disk: ${free:-?} GiB free here; the set-ups still to do need about $need GiB"
if [ -n "$free" ] && [ "$free" -lt "$need" ]; then
  echo "[test] WARNING: too little disk for the set-ups (${free} GiB free, about ${need} GiB needed): free some, or" \
       "skip tiers with MEGATRON_RING_SKIP_FLOOR=1 (about 6 GiB) or MEGATRON_RING_SKIP_PY312=1 (about 7 GiB)" >&2
fi
# The background work of the header (nice 19): the floor's set-up and then its fast tier (not serial; a test that
# starts processes is marked slow, so it starts none), and the Python 3.12 and Bridge set-ups.
bglog=$(mktemp -d); trap 'rm -rf "$bglog"' EXIT
bgpids=()
if [ "$floor" = 1 ]; then
  ( lowest
    MEGATRON_RING_FLAVOR=floor bash scripts/setup_env.sh test > "$bglog/floor.setup" 2>&1 || { echo "$?" > "$bglog/floor.rc"; exit; }
    run_floor_fast > "$bglog/floor.out" 2>&1; echo "$?" > "$bglog/floor.rc" ) & floorpid=$!; bgpids+=("$floorpid")
fi
if [ "$py312" = 1 ]; then
  ( lowest; MEGATRON_RING_FLAVOR=py312 bash scripts/setup_env.sh test && if [ "$bridge" = 1 ]; then
     bash scripts/setup_bridge.sh; fi ) > "$bglog/py312.setup" 2>&1 & py312pid=$!; bgpids+=("$py312pid")
fi
bash scripts/setup_env.sh test || { rc=$?; for p in "${bgpids[@]}"; do kill -- "$p" 2>/dev/null; done; exit "$rc"; }
.venv/bin/python -c 'import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"[test] {n} CUDA GPU(s): tests/gpu " + ("runs" if n else "is skipped (no usable GPU)"))' || true

t0=$(date +%s)
# the fast tier runs the numerics tests in torch's own instruction set: its report stands for that configuration in
# the matrix below, which does not run it again
native_report="$bglog/native.report"; : > "$native_report"
MEGATRON_RING_NUMERICS_REPORT="$native_report" run_pytest .venv -m "not slow and not serial" "${PAR[@]}" "$@"; rcfast=$?
echo "[test] fast tier (-m 'not slow', not serial): rc=$rcfast in $(( $(date +%s) - t0 )) s"
rcnum=0
if [ "${MEGATRON_RING_SKIP_NUMERICS_MATRIX:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/numerics_matrix.sh --fast --native-report "$native_report"; rcnum=$?
fi
t0=$(date +%s)
run_pytest .venv -m "slow and not serial" "${PAR[@]}" "$@"; rc311=$?
echo "[test] Python 3.11 slow tier, not serial: rc=$rc311 in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
run_pytest .venv -m serial "$@"; rcser=$?
echo "[test] Python 3.11 serial tests (fast and slow): rc=$rcser in $(( $(date +%s) - t0 )) s"
[ "$rc311" -eq 0 ] || rcser=$rc311
[ "$rcfast" -eq 0 ] || rcser=$rcfast
rc311=$rcser
# The Python 3.12 tier, with the Bridge tests in one background pytest process beside it (multi-process Megatron
# jobs whose ranks wait on each other leave the cores idle part of the time), at normal priority
rcfloor=0; rcbridge=0; rc312=0
if [ "$py312" = 1 ]; then
  t0=$(date +%s); wait "$py312pid"; r=$?
  sed "s/^/[setup py312] /" "$bglog/py312.setup"
  echo "[test] the Python 3.12 set-ups ended (rc=$r), waited for $(( $(date +%s) - t0 )) s"
  if [ "$r" -ne 0 ]; then
    rc312=$r; bridge=0
  else
    if [ "$bridge" = 1 ]; then ( run_bridge > "$bglog/bridge.out" 2>&1; echo "$?" > "$bglog/bridge.rc" ) & bridgepid=$!; fi
    echo "[test] megatron-core $(.venv312/bin/python -c 'from megatron.core import package_info as p; print(p.__version__)' 2>/dev/null), Python 3.12: tests/megatron tests/fake_cuda"
    t0=$(date +%s)
    # no serial tests live in tests/megatron or tests/fake_cuda (tests/conftest.py fails one that reaches a worker)
    run_pytest .venv312 "${PAR[@]}" "${opts[@]}" tests/megatron tests/fake_cuda --ignore=tests/megatron/test_bridge.py \
      --ignore=tests/megatron/test_bridge_hybrid.py; rc312=$?
    echo "[test] Python 3.12 tier: rc=$rc312 in $(( $(date +%s) - t0 )) s"
  fi
fi
if [ "$bridge" = 1 ]; then
  t0=$(date +%s); wait "$bridgepid"
  echo "[test] the Bridge run ended $(( $(date +%s) - t0 )) s after the Python 3.12 tier; its output:"
  cat "$bglog/bridge.out"; rcbridge=$(cat "$bglog/bridge.rc" 2>/dev/null || echo 1)
fi
if [ "$floor" = 1 ]; then
  t0=$(date +%s); wait "$floorpid"
  echo "[test] the torch floor's set-up and fast tier ended $(( $(date +%s) - t0 )) s after the tiers above; their output:"
  sed "s/^/[setup floor] /" "$bglog/floor.setup"
  [ -f "$bglog/floor.out" ] && cat "$bglog/floor.out"
  rcfloor=$(cat "$bglog/floor.rc" 2>/dev/null || echo 1)
  if [ -f "$bglog/floor.out" ]; then
    echo "[test] torch floor, serial tests (alone)"
    run_pytest .venv-floor -m "not slow and serial" -q -p no:cacheprovider; r=$?
    [ "$rcfloor" -eq 0 ] && rcfloor=$r
  else
    echo "[test] the floor set-up failed (rc=$rcfloor)"
  fi
fi
echo "[test] fast tier: rc=$rcfast; torch floor: rc=$rcfloor; numerics under every instruction set: rc=$rcnum; Python 3.11 / megatron-core 0.16.1: rc=$rc311; Python 3.12 / megatron-core 0.19.2: rc=$rc312; Megatron-Bridge: rc=$rcbridge"
[ "$rc311" -eq 0 ] && [ "$rcfloor" -eq 0 ] && [ "$rcnum" -eq 0 ] && [ "$rc312" -eq 0 ] && [ "$rcbridge" -eq 0 ]
