"""Workers for multi-latent attention on packed (THD) batches (tests/megatron/test_mla_thd.py).

MLA applies its RoPE itself, to packed batches in Megatron's per-document order (each document padded to a
multiple of 2 x CP, cu_seqlens_q_padded). Under test: GPTModel with MLA and the stock ``--spec`` core attention
(``ring_core()``, ``batch_split="megatron"``) on the packed batch split by Megatron's own per-document split, at
CP = world. The independent reference: the same model with Megatron's own core attention at CP = 1 on the packed
batch's real documents one at a time (BSHD, positions from 0). ``how="ring_split"``: the batch split by the
ring's own stream layout with the ring's core attention (``batch_split="ring"``): refused by name.
"""
from __future__ import annotations

from typing import Any

import torch

from tests.helpers.cp_step import reduce_over_cp
from tests.megatron import feature_workers as FW
from tests.megatron import hybrid_workers as HW

M = dict(FW.BASE, doc_lengths=(13, 5, 22, 1, 9, 3), pack_cp=2, data_seed=3)


def _build(world: int, ring: bool, batch_split: str = "megatron"):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_ring.megatron import get_gpt_layer_ring_spec, use_layout_rope
    from megatron_ring.megatron.attention.module import RingDotProductAttention

    torch.manual_seed(M["seed"])
    if ring:
        spec = get_gpt_layer_ring_spec(normalization="RMSNorm", multi_latent_attention=True)
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=RingDotProductAttention, params={"batch_split": batch_split})
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", multi_latent_attention=True)
        spec.submodules.self_attention.submodules.core_attention = FW._reference_core()
    cfg = FW._config("mla", world)
    with FW._cuda_device_is_cpu():
        model = GPTModel(cfg, spec, vocab_size=M["vocab"], max_sequence_length=HW.packed_layout(M)[1][-1],
                         position_embedding_type="none")
    if ring:
        use_layout_rope(model, "zigzag")  # as the docs ask for packed batches: MLA's own RoPE is left to MLA
    return model


def _record_v_widths(widths: list) -> None:
    """Each ring call's (V head dim the core attention got, V head dim it handed the ring) into ``widths``."""
    import megatron_ring
    from megatron_ring.megatron.attention import module

    real_forward, real_ring = module.RingDotProductAttention.forward, megatron_ring.ring_attention
    got: list = []

    def forward(self, query, key, value, *a, **kw):
        got.append(value.shape[-1])
        return real_forward(self, query, key, value, *a, **kw)

    def ring(q, k, v, **kw):
        widths.append((got[-1], v.shape[-1]))
        return real_ring(q, k, v, **kw)
    module.RingDotProductAttention.forward, megatron_ring.ring_attention = forward, ring


def worker(rank: int, world: int, how: str) -> dict[str, Any]:
    """``how``: ``thd`` (ring, Megatron's split), ``documents`` (reference, CP = 1), ``ring_split`` (the refusal),
    ``thd_padded_v`` (``thd`` with V handed to the ring as Megatron padded it: the control of the V widths):
    the masked loss and the gradients (rank 0), or the error raised; ``v_widths``: per ring call, V's head dim
    as the core attention got it and as it handed it to the ring."""
    torch.set_num_threads(1)
    widths: list = []
    _record_v_widths(widths)
    if how == "thd_padded_v":
        from megatron_ring.megatron.attention.module import RingDotProductAttention

        RingDotProductAttention._megatron_padded_v = lambda self, query, value: False
        how = "thd"
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ring.megatron.data.batch import get_batch_on_this_cp_rank
    from megatron_ring.megatron.data.token_order import attention_layout
    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(M["seed"])
            model = _build(world, how != "documents", "ring" if how == "ring_split" else "megatron")
            cp_group = ps.get_context_parallel_group()
            full = HW.make_packed_batch(M, 0)
            total = full["loss_mask"].sum()
            try:
                if how == "documents":
                    local, total = HW._documents_step(model, full, M)
                else:
                    cu, cup = HW.packed_layout(M)
                    # Megatron's per-document split (DocumentZigzag of cu_seqlens_padded: what Megatron's own THD
                    # split hands each rank, tests/megatron/test_token_order.py), or the ring's own stream split
                    layout = attention_layout("thd", world, "zigzag", cup) if how == "thd" else "zigzag"
                    mine = get_batch_on_this_cp_rank(dict(full), layout=layout, cp_size=world, cp_rank=cp_group.rank())
                    cu_t, cup_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)
                    width = max(b - a for a, b in zip(cup[:-1], cup[1:]))
                    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                                             cu_seqlens_q_padded=cup_t, cu_seqlens_kv_padded=cup_t,
                                             max_seqlen_q=width, max_seqlen_kv=width)
                    tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"],
                                packed_seq_params=params)
                    local = (tok * mine["loss_mask"]).sum()
                    (local / total).backward()
            except Exception as e:  # noqa: BLE001 - the refusal test reads it
                return dict(error=f"{type(e).__name__}: {e}")
            rep = reduce_over_cp(local, model, cp_group, world)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            return dict(loss=float(rep / total), grads=grads if rank == 0 else None, v_widths=sorted(set(widths)))
        finally:
            ps.destroy_model_parallel()
