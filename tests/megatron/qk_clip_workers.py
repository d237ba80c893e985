"""Workers for the QK-clip test: a GPT model on the ring spec with ``qk_clip`` on, trained a few steps at CP = P.

Each step runs two micro-batches (the core attention accumulates ``current_max_attn_logits`` over them), the
optimizer step, then Megatron's own ``clip_qk`` (MAX all-reduce over DP x CP, the clip, the reset), as
Megatron-LM's ``train_step`` does. Recorded per step: this rank's values before the reduce, the reduced ones
(what Megatron clips with), the logged max, whether each layer's value was reset, and the reported loss.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.megatron import megatron_workers as W

MODEL = dict(W.MODEL, seq=32)
MICRO_BATCHES = 2


def _record_reduced(attention, into: list) -> None:
    """Wrap one layer's ``clip_qk`` so that it records the reduced max logits it clips with."""
    original = attention.clip_qk

    def clip_qk():
        into.append(attention.core_attention.current_max_attn_logits.clone())
        return original()

    attention.clip_qk = clip_qk


def worker(rank: int, world: int, steps: int, threshold: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.qk_clip import clip_qk

    from megatron_ring.megatron import (RingConfig, allreduce_gradients, destroy_context_parallel, get_batch_on_this_cp_rank, initialize_context_parallel, reduce_loss_over_cp)
    from megatron_ring_lab.cpu import megatron_cpu

    m = MODEL
    with megatron_cpu():
        try:
            initialize_context_parallel(RingConfig(context_parallel_size=world, layout="zigzag"), seq_length=m["seq"])
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
            model = W._build(m, 1, world, ring=True)
            layers = [layer.self_attention for layer in model.decoder.layers]
            for attention in layers:
                attention.config.qk_clip, attention.config.qk_clip_threshold = True, threshold
            reduced: list[list] = [[] for _ in layers]
            for attention, into in zip(layers, reduced):
                _record_reduced(attention, into)
            chunks = [SimpleNamespace(module=SimpleNamespace(module=model))]  # Megatron's wrapped chunks
            opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
            out: dict[str, Any] = dict(losses=[], before=[], logged=[], reset=[])
            b = m["micro_batch"]
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = 0.0
                for mb in range(MICRO_BATCHES):
                    mine = get_batch_on_this_cp_rank(W.make_batch(m, step * MICRO_BATCHES + mb, b))
                    tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
                    red = reduce_loss_over_cp(tok, mine["loss_mask"])
                    (red.loss / MICRO_BATCHES).backward()
                    loss += float(red.reported) / MICRO_BATCHES
                allreduce_gradients(model)
                opt.step()
                out["before"].append([a.core_attention.current_max_attn_logits.clone() for a in layers])
                out["logged"].append(clip_qk(chunks, log_max_only=False))
                out["reset"].append([a.core_attention.current_max_attn_logits is None for a in layers])
                out["losses"].append(loss)
            out["reduced"] = [[r[s] for r in reduced] for s in range(steps)]
            out["dpcp"] = ps.get_data_parallel_world_size(with_context_parallel=True)
            return out
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()
