#!/usr/bin/env bash
# One command for GPU users: on whatever NVIDIA GPUs this machine has, run
#   1. tests/gpu (every kernel and the whole engine forward and backward vs float64, the steady-state sync
#      check, CUDA-graph capture, the Megatron step; test_fake_tier_on_gpu.py runs every case of the
#      fake-CUDA tier, tests/fake_cuda, for real: real CUDA tensors, streams and autograd);
#   2. with 2 or more GPUs: ring attention over NCCL on all of them vs float64 (tests/gpu/nccl_check.py);
#   3. with TransformerEngine installed and 2 or more GPUs: ours vs TransformerEngine's context parallelism,
#      side by side (tests/gpu/te_cp_check.py: errors vs float64 and fwd+bwd times);
#   4. the GPU benchmark rows (each rank's ring schedule on one GPU vs one-GPU attention, P = 2 4 8 at 2K and 8K
#      tokens per rank, 32:8 GQA heads of 128, bf16, causal): efficiency eager and CUDA-graphed, host time and
#      kernel launches per call, peak memory, and packed THD with a real document-length mix (striped, and
#      Megatron's per-document zigzag) against one-GPU variable-length flash (megatron_ring_lab.bench.gpu);
#   5. the Megatron layer's host time per call on the GPU (RingDotProductAttention forward+backward at CP = 1 vs
#      the same ring_attention call made directly: the glue's share; megatron_ring_lab.bench.layer_host_time);
#   6. the host time to plan a new document layout on this machine's CPU (what the first layer of every packed
#      micro-batch pays, P = 4 8 at the same tokens per rank; megatron_ring_lab.bench.plan_time);
# and print one table (tests/gpu/check_table.py); exit 1 if any step failed or ran out of its time budget.
# Needs no download and no venv: the project venv if there is one, else the system python3 (torch with CUDA,
# megatron-core, pytest; pytest-timeout is used only where installed). Budget: each step under `timeout`,
# under 10 minutes in all on one GPU (the steps ran in 3 minutes on an H200 before the planning step and the
# per-document rows were added; on 2026-11-29 tests/gpu took 102-171 s, its fake-tier file in a second process beside
# the rest, and the other steps about 110 s). On a machine without a usable GPU it says so and exits 0.
# Env: MEGATRON_RING_VENV (default .venv), GPU_CHECK_SEQ (default 8192: the NCCL and TE checks),
# GPU_CHECK_TOKENS_PER_RANK (default "2048 8192": the benchmark rows), GPU_CHECK_LOGS (a folder that keeps each
# step's log; default: a temporary folder, removed at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
# the library and the lab from this checkout, whatever Python runs them (a venv or a system Python)
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
PY="${MEGATRON_RING_VENV:-.venv}/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
SEQ="${GPU_CHECK_SEQ:-8192}"
TOKENS="${GPU_CHECK_TOKENS_PER_RANK:-2048 8192}"  # the benchmark rows' tokens per rank
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "[gpu_check] $PY cannot import torch: install a CUDA build of torch (or set MEGATRON_RING_VENV)." >&2
  exit 1
fi
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ "$NGPU" = 0 ]; then
  echo "[gpu_check] no usable CUDA GPU here (torch.cuda.is_available() is False, or torch is a CPU build:" \
       "$("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null))."
  echo "[gpu_check] nothing to check on this machine; CPU users run: bash scripts/test.sh"
  exit 0
fi
if [ -n "${GPU_CHECK_LOGS:-}" ]; then  # keep every step's log there
  OUT="$GPU_CHECK_LOGS"; mkdir -p "$OUT"
else
  OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT
fi
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
echo "[gpu_check] $NGPU GPU(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))'), python $PY"
# pytest-timeout (setup.cfg's `timeout`) only where installed; the step's `timeout` bounds it anyway
PYTEST_ARGS=(-q -rfE -p no:cacheprovider --durations=12)
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then
  PYTEST_ARGS+=(--timeout 240)
else
  PYTEST_ARGS+=(-W "ignore::pytest.PytestConfigWarning")
  echo "[gpu_check] pytest-timeout is not installed: no per-test limit (the step's 270 s limit holds)"
fi
if "$PY" -c 'import pytest' >/dev/null 2>&1; then
  # the fake tier's cases for real in a second process beside the rest (tests/gpu is serial: no pytest-xdist);
  # pytest.txt: both logs, then one line with both summaries
  timeout 270 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/gpu/test_fake_tier_on_gpu.py > "$OUT/pytest-fake.txt" 2>&1 &
  fakepid=$!
  timeout 270 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/gpu --ignore=tests/gpu/test_fake_tier_on_gpu.py \
    > "$OUT/pytest-main.txt" 2>&1
  rcmain=$?; wait "$fakepid"; rcfake=$?
  { cat "$OUT/pytest-fake.txt" "$OUT/pytest-main.txt"
    echo "$(tail -n 1 "$OUT/pytest-main.txt") | the fake tier's cases for real: $(tail -n 1 "$OUT/pytest-fake.txt")"
  } > "$OUT/pytest.txt"
  if [ "$rcmain" != 0 ]; then echo "$rcmain" > "$OUT/pytest.rc"; else echo "$rcfake" > "$OUT/pytest.rc"; fi
else
  echo "pytest is not installed for $PY: pip install pytest" > "$OUT/pytest.txt"; echo 1 > "$OUT/pytest.rc"
fi
if [ "$NGPU" -ge 2 ]; then
  timeout 60 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --master-addr 127.0.0.1 \
    --master-port "$(free_port)" tests/gpu/nccl_check.py --seq "$SEQ" > "$OUT/nccl.txt" 2>&1
  echo $? > "$OUT/nccl.rc"
  if "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
    timeout 60 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --master-addr 127.0.0.1 \
      --master-port "$(free_port)" tests/gpu/te_cp_check.py --seq "$SEQ" > "$OUT/te.txt" 2>&1
    echo $? > "$OUT/te.rc"
  fi
fi
timeout 90 "$PY" -m megatron_ring_lab.benchmark --layer-host-time --layer-device cuda --heads 32 --kv-heads 8 \
  --head-dim 128 --iters 300 > "$OUT/layer.txt" 2>&1
echo $? > "$OUT/layer.rc"
timeout 60 "$PY" -m megatron_ring_lab.benchmark --plan-time --world-sizes 4 8 --tokens-per-rank $TOKENS --iters 3 \
  > "$OUT/plan.txt" 2>&1
echo $? > "$OUT/plan.rc"
timeout 150 "$PY" -m megatron_ring_lab.benchmark --gpu-row --world-sizes 2 4 8 --tokens-per-rank $TOKENS \
  --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --causal --iters 3 --gpu-docs --graphed \
  --gpu-docs-layouts striped doc-zigzag \
  > "$OUT/bench.json" 2> "$OUT/bench.err"
echo $? > "$OUT/bench.rc"
"$PY" tests/gpu/check_table.py "$OUT" "$NGPU"
