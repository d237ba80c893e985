#!/usr/bin/env bash
# Stock Megatron-LM pretrain_hybrid.py (unpatched checkout: main or core_v0.19.0) with ring attention through
# --spec, on CPU/gloo. A checkout without pretrain_hybrid.py (core_v0.16.1) runs its older name for the hybrid
# stack, pretrain_mamba.py (MambaModel; the pattern flag is --hybrid-override-pattern there, with --num-layers).
#
#   PATTERN='M*M-' bash scripts/stock_megatron_lm_hybrid.sh MEGATRON_LM_CHECKOUT CP [EXTRA_FLAGS...]
#
# CP = 1 runs the reference: Megatron's hybrid stack spec with Megatron's own core attention
# (--spec megatron_ring.megatron.spec.hybrid reference_hybrid_stack_spec: megatron-core ships only
# TransformerEngine hybrid specs, and this machine has no TransformerEngine, so the stack is built from the
# local equivalents, exactly as ring_hybrid_stack_spec builds it); CP > 1 adds
# --spec megatron_ring.megatron.spec ring_hybrid_stack_spec. CONTROL=1 keeps the reference spec at CP > 1
# (Megatron's local attention refuses CP > 1). Where CUDA is available, drop the CPU opt-in (the module
# megatron_ring_lab.cpu) and the CPU flags. Needs: torch, megatron-core's dependencies and einops,
# megatron_ring importable, and on CPU the checkout's dataset helper built (or copied from the
# megatron-core 0.19 wheel: megatron/core/datasets/helpers_cpp*.so; docs/megatron-runs.md).
#
# PACKED=1: packed THD through stock get_batch (--mock-data --dataloader-inter-document-masking: documents
# unpadded, the stream split over CP as one sequence) with --position-embedding-type none (Megatron's THD RoPE
# cannot follow that split; the ring spec refuses it by name, as it refuses M/G layers there); the ring spec at
# every CP, CP=1 included (Megatron's local attention refuses packed sequences).
#
# SFT=DIR: packed THD through --sft (SFTDataset: every document padded to a multiple of 2 x CP at CP > 1 and
# split per document, the order Megatron's Mamba/GDN context parallelism uses), RoPE on, with
# --calculate-per-token-loss (the loss-masked padding differs between CP ranks; docs/megatron-runs.md). DIR is
# what `python scripts/make_sft_fixture.py DIR` writes: DIR/tokenizer (--tokenizer-type SFTTokenizer
# --sft-tokenizer-prompt-format nemotron-h-aligned) and DIR/sft.jsonl (--data-path). Needs the `datasets` and
# `transformers` packages importable (SFT_DEPS=DIR puts DIR on PYTHONPATH after the checkout and megatron_ring).
# The ring spec at every CP, CP=1 included, as for PACKED=1. HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set: nothing
# is downloaded; the datasets cache goes to DIR/hf-cache.
set -euo pipefail
MLM=$(cd "$1" && pwd); CP=$2; shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
ITERS=${ITERS:-10}
PATTERN=${PATTERN:-M*M-}
if [ -f "$MLM/pretrain_hybrid.py" ]; then SCRIPT=pretrain_hybrid.py; LAYERS=(--hybrid-layer-pattern "$PATTERN")
else SCRIPT=pretrain_mamba.py; LAYERS=(--num-layers "${#PATTERN}" --hybrid-override-pattern "$PATTERN"); fi
MODEL=("${LAYERS[@]}" --hidden-size 64 --num-attention-heads 4 --group-query-attention
       --num-query-groups 2 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2
       --global-batch-size 4 --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
       --lr-warmup-iters 1 --weight-decay 0.01 --clip-grad 1.0 --position-embedding-type rope
       --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
       --attention-dropout "${ATTN_DROPOUT:-0}" --hidden-dropout 0
       --make-vocab-size-divisible-by 64 --seed 1234 --log-interval 1 --eval-iters 0
       --eval-interval 1000 --split 100,0,0
       --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2
       --linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 4 --linear-num-value-heads 8
       --linear-conv-kernel-dim 4)
if [ -n "${SFT:-}" ]; then
  SFTDIR=$(cd "$SFT" && pwd)
  MODEL+=(--sft --sft-tokenizer-prompt-format nemotron-h-aligned --tokenizer-type SFTTokenizer
          --tokenizer-model "$SFTDIR/tokenizer" --data-path "$SFTDIR/sft.jsonl" --calculate-per-token-loss
          --no-create-attention-mask-in-dataloader --num-workers 0)
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$SFTDIR/hf-cache" TRANSFORMERS_OFFLINE=1
else
  MODEL+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128)
fi
case "$PATTERN" in *E*) MODEL+=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 0
                                 --moe-router-load-balancing-type none --moe-token-dispatcher-type allgather);; esac
CPU=(--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
     --transformer-impl local --rerun-mode disabled --no-rope-fusion --no-bias-swiglu-fusion
     --no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm)
SPEC=(--spec megatron_ring.megatron.spec.hybrid reference_hybrid_stack_spec)
if [ "$CP" -gt 1 ] && [ -z "${CONTROL:-}" ]; then SPEC=(--spec megatron_ring.megatron.spec ring_hybrid_stack_spec); fi
if [ -n "${SFT:-}" ]; then SPEC=(--spec megatron_ring.megatron.spec ring_hybrid_stack_spec); fi
if [ -n "${PACKED:-}" ]; then
  SPEC=(--spec megatron_ring.megatron.spec ring_hybrid_stack_spec --dataloader-inter-document-masking
        --position-embedding-type "${POSITION_EMBEDDING:-none}")
fi
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cd "$MLM"
export PYTHONPATH="$MLM:$HERE:$HERE/lab${PYTHONPATH:+:$PYTHONPATH}${SFT_DEPS:+:$SFT_DEPS}"
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --nproc-per-node "$CP" --master-addr 127.0.0.1 --master-port "$PORT" \
  -m megatron_ring_lab.cpu "$SCRIPT" "${MODEL[@]}" "${CPU[@]}" \
  --context-parallel-size "$CP" "${SPEC[@]}" "$@"
