"""Workers for tests/megatron/test_per_call_group.py: ring attention on the group each call brings."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

COMM_TYPES = ("p2p", "all_gather", "a2a", "auto")


def per_call_group_worker(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """World 4, a model configured for CP=4 on the whole world (its pg_collection.cp), no registered ring.
    Each call brings its own group in ``packed_seq_params`` (``cp_group`` of size 2 or 4, or
    ``local_cp_size=1`` without a group): THD documents, causal, GQA (4 query heads, 2 K/V groups), every
    comm type. Returns, per case, the worst ratio of the error vs the float64 per-document reference (outputs
    and input gradients over this rank's share) to the derived bound (tests/helpers/numerics.py), and the
    refusals' messages."""
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.reference import doc_attention_reference
    from megatron_ring import shard_sequence
    from megatron_ring.megatron import (ContextParallelConfigError, RingDotProductAttention)
    from megatron_ring_lab.cpu import megatron_cpu
    from tests.helpers.numerics import max_err, score_bound, tol
    from tests.helpers.reference import outputs_and_grads

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, same order
    whole = dist.new_group(list(range(world)))
    out: dict[str, Any] = {}
    with megatron_cpu():
        for ct in COMM_TYPES:
            cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                    context_parallel_size=world, use_cpu_initialization=True,
                                    attention_dropout=0.0, cp_comm_type=ct)
            attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                           pg_collection=_Collection(whole))
            for size in sizes:
                if size == 1:
                    group, kwargs = None, dict(local_cp_size=1)
                else:
                    group = whole if size == world else pairs[rank // 2]
                    kwargs = dict(cp_group=group, local_cp_size=size)
                T = 8 * max(size, 2) * 2
                lens = [3, 9, T - 12 - 5]  # three documents and 5 tokens of end padding
                cu = torch.tensor([0] + lens).cumsum(0).int()
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         max_seqlen_q=max(lens), max_seqlen_kv=max(lens), **kwargs)
                g = torch.Generator().manual_seed(100 * size + 7 + (rank // 2 if size == 2 else 0))
                q, dout = (torch.randn(T, 4, 8, generator=g).double() for _ in range(2))  # fp32 values: the
                k, v = (torch.randn(T, 2, 8, generator=g).double() for _ in range(2))   # reference sees the inputs
                ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, cu.tolist(), True), q, k, v, dout)
                local = [shard_sequence(t, 0, group=group, layout="zigzag").float() if group is not None
                         else t.float() for t in (q, k, v, dout)]
                got = outputs_and_grads(lambda a, b, c: attn(a.unsqueeze(1), b.unsqueeze(1), c.unsqueeze(1), None,
                                                             packed_seq_params=params).view(a.shape), *local)
                real = (shard_sequence(torch.arange(T), 0, group=group, layout="zigzag") if group is not None
                        else torch.arange(T)) < int(cu[-1])
                mine = [shard_sequence(r, 0, group=group, layout="zigzag") if group is not None else r for r in ref]
                sigma = score_bound(q, k)
                out[f"{ct}/size{size}"] = max(
                    max_err(a[real], r[real]) / tol(full.abs().max().item(), dtype=torch.float32, n=T, sigma=sigma,
                                                    blocks=2 * size)
                    for a, r, full in zip(got, mine, ref))
        # a2a+p2p needs the registered ring's sub-rings: refused by name on a group a call brings
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                context_parallel_size=world, use_cpu_initialization=True, attention_dropout=0.0,
                                cp_comm_type="a2a+p2p")
        attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=_Collection(whole))
        cu = torch.tensor([0, 32]).int()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=32,
                                 max_seqlen_kv=32, cp_group=pairs[rank // 2], local_cp_size=2)
        try:
            attn(torch.zeros(16, 1, 4, 8), torch.zeros(16, 1, 2, 8), torch.zeros(16, 1, 2, 8), None,
                 packed_seq_params=params)
            out["a2a+p2p"] = "no error"
        except ContextParallelConfigError as e:
            out["a2a+p2p"] = f"{e.flag}: {e}"
    return out


class _Collection:
    """The part of Megatron's ProcessGroupCollection core attention reads (tp of size 1 from parallel_state
    is not needed: tp is given as a one-rank group)."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.tp = _One()


class _One:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def collection_registration_worker(rank: int, world: int) -> dict[str, Any]:
    """initialize_context_parallel(pg_collection=...) with parallel_state empty (Megatron-Bridge's
    decentralized process groups): uses the collection's cp group and builds no groups of its own."""
    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import RingConfig, destroy_context_parallel, initialize_context_parallel

    cp = dist.new_group(list(range(world)))
    collection = _Collection(cp)
    collection.dp_cp = cp
    try:
        state = initialize_context_parallel(RingConfig(context_parallel_size=world), pg_collection=collection)
        return {"same_group": state.group is cp, "ranks": list(state.global_ranks),
                "parallel_state_built": ps.model_parallel_is_initialized()}
    finally:
        destroy_context_parallel()


def hybrid_batch_worker(rank: int, world: int) -> dict[str, Any]:
    """World 4, TP 2 x CP 2 with megatron-core's hybrid groups (DP x CP = 2): ``get_hybrid_cp_batch`` on a
    16-token document, given to the first TP rank only (Megatron's hybrid loop leaves the others' iterator
    None), for local_cp_size 1 and 2; and a 10-token document on 2 ranks (zigzag needs a multiple of 4)."""
    from megatron.core import parallel_state as ps

    from megatron_ring import get_layout
    from megatron_ring.megatron import get_hybrid_cp_batch

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                 hybrid_context_parallel=True)
    first = ps.get_tensor_model_parallel_rank() == 0
    out: dict[str, Any] = {}
    try:
        for size in (1, 2):
            n = 16
            sample = {"tokens": torch.arange(n) + 100, "labels": torch.arange(n) + 200,
                      "loss_mask": torch.ones(n), "position_ids": torch.arange(n),
                      "local_cp_size": torch.tensor(size, dtype=torch.int32)} if first else None
            batch, params = get_hybrid_cp_batch(sample, layout="zigzag")
            group = ps.get_hybrid_data_context_parallel_groups(group_size=2)
            pos = get_layout("zigzag").positions(n, 2, group.rank()) if size == 2 else torch.arange(n)
            out[size] = {
                "tokens_ok": batch["tokens"].equal((pos + 100).view(1, -1)),
                "labels_ok": batch["labels"].equal((pos + 200).view(1, -1)),
                "positions_ok": batch["position_ids"].equal(pos.view(1, -1)),
                "mask_ok": batch["loss_mask"].equal(torch.ones(1, pos.numel())),
                "group_ok": params.cp_group is (group if size == 2 else None),
                "local_cp_size": params.local_cp_size, "cu": params.cu_seqlens_q.tolist(),
                "qkv_format": params.qkv_format}
        sample = {"tokens": torch.arange(10), "labels": torch.arange(10), "loss_mask": torch.ones(10),
                  "local_cp_size": 2} if first else None
        try:
            get_hybrid_cp_batch(sample, layout="zigzag")
            out["uneven"] = "no error"
        except ValueError as e:
            out["uneven"] = str(e)
    finally:
        ps.destroy_model_parallel()
    return out
