#!/usr/bin/env bash
# Stock Megatron-LM pretrain_gpt.py (unpatched checkout) with ring attention through --spec, on CPU/gloo.
#
#   bash scripts/stock_megatron_lm.sh MEGATRON_LM_CHECKOUT CP [EXTRA_FLAGS...]
#
# CP = 1 runs Megatron's own attention (no --spec: the reference); CP > 1 adds
# --spec megatron_ring.megatron.spec ring_layer_spec. MEGATRON_RING_* variables (docs/megatron-runs.md) pass
# through, e.g. MEGATRON_RING_COMM_DTYPE=bf16. Where CUDA is available, drop the CPU opt-in (the module
# megatron_ring_lab.cpu.training) and the CPU flags. Needs: torch, megatron-core's dependencies,
# megatron_ring importable (pip install -e . or PYTHONPATH), and on CPU the checkout's dataset helper built
# (or copied from the megatron-core 0.19 wheel: megatron/core/datasets/helpers_cpp*.so). Works for main,
# core_r0.19.0 and core_v0.16.1 checkouts; core_v0.16.1's megatron/training also needs triton, six, regex,
# pyyaml and pydantic (PYTHON=a Python 3.12 with triton, PYTHONPATH=a directory holding the other four: they
# stay after the checkout and megatron_ring on the path; docs/megatron-runs.md).
set -euo pipefail
MLM=$(cd "$1" && pwd); CP=$2; shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
ITERS=${ITERS:-10}
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
       --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4
       --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1
       --weight-decay 0.01 --clip-grad 1.0 --position-embedding-type rope --normalization RMSNorm --swiglu
       --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
       --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 64
       --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000 --split 100,0,0)
CPU=(--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
     --transformer-impl local --rerun-mode disabled --no-rope-fusion --no-bias-swiglu-fusion
     --no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm)
SPEC=()
if [ "$CP" -gt 1 ]; then SPEC=(--spec megatron_ring.megatron.spec ring_layer_spec); fi
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cd "$MLM"
export PYTHONPATH="$MLM:$HERE:$HERE/lab${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --nproc-per-node "$CP" --master-addr 127.0.0.1 --master-port "$PORT" \
  -m megatron_ring_lab.cpu pretrain_gpt.py "${MODEL[@]}" "${CPU[@]}" \
  --context-parallel-size "$CP" "${SPEC[@]}" "$@"
