"""Workers for the document-mask Megatron tests (``--reset-attention-mask`` batches, packed THD params,
a whole GPTModel fed packed batches with ``PackedSeqParams``).

Reference: Megatron-Core's own GPTModel (local DotProductAttention, which applies the boolean
``attention_mask``) at TP = CP = 1 on one process, fed the same documents as a causal-within-document mask.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.megatron import megatron_workers as W

EOD = 0


def doc_batch(m: dict, step: int, n_seqs: int) -> dict[str, torch.Tensor]:
    """``make_batch`` with EOD tokens at random places (documents of length 1 included), the
    ``--reset-attention-mask`` mask and ``--reset-position-ids`` positions."""
    from megatron_ring.megatron.data.documents import document_mask

    batch = W.make_batch(m, step, n_seqs)
    g = torch.Generator().manual_seed(99 + step % m["data_cycle"])
    tokens = batch["tokens"].clone()
    tokens[tokens == EOD] = 1
    for row in range(n_seqs):
        cuts = torch.randperm(m["seq"] - 1, generator=g)[: 3 + row][:]
        tokens[row, cuts] = EOD
        tokens[row, 5:7] = EOD  # a document of length 1
    mask, pos = document_mask(tokens, EOD)
    return dict(tokens=tokens, labels=batch["labels"], loss_mask=batch["loss_mask"], position_ids=pos,
                attention_mask=mask)


def reference_worker(rank: int, world: int, m: dict, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            model = W._build(m, 1, 1, ring=False)
            return _train(model, m, steps, lambda b: b, None)
        finally:
            ps.destroy_model_parallel()


def _train(model, m, steps, shard, reduce) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
    losses, grads0 = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        mb = shard(doc_batch(m, step, m["micro_batch"]))
        kw = {"packed_seq_params": mb["packed_seq_params"]} if "packed_seq_params" in mb else {}
        tok = model(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"], **kw)
        if reduce is None:
            loss = (tok * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
            loss.backward()
            losses.append(float(loss))
        else:
            losses.append(reduce(tok, mb["loss_mask"]))
        if step == 0:
            grads0 = W._full_grads(model, _tp_group()) if reduce is not None else \
                {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return dict(losses=losses, grads=grads0)


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def ring_worker(rank: int, world: int, m: dict, tp: int, cp: int, layouts: list[str], steps: int) -> dict:
    """``--reset-attention-mask`` batches (the mask) at (TP, CP) for each layout, keyed by layout."""
    res = ring_configs_worker(rank, world, m, [(tp, cp, layout) for layout in layouts], steps, packed=False)
    return {key.split("-", 1)[1]: r for key, r in res.items()}


def ring_configs_worker(rank: int, world: int, m: dict, configs: list[tuple[int, int, str]], steps: int,
                        packed: bool) -> dict:
    """GPTModel (ring spec, ``use_layout_rope``) at each (TP, CP, layout) of ``configs``, all in these
    processes, keyed ``tp{tp}cp{cp}-{layout}``: losses and step-0 full gradients (rank 0). ``packed``: the
    batch goes in as ONE packed stream with ``PackedSeqParams`` (Megatron's THD path) instead of the mask."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import (ContextParallelConfigError, RingConfig, allreduce_gradients, destroy_context_parallel, get_batch_on_this_cp_rank, initialize_context_parallel, reduce_loss_over_cp)
    from megatron_ring_lab.cpu import megatron_cpu
    from megatron_ring.megatron.data.documents import packed_batch

    def reduce(tok, loss_mask):
        red = reduce_loss_over_cp(tok, loss_mask)
        red.loss.backward()
        allreduce_gradients(model)
        return float(red.reported)

    def shard(batch):
        if not packed:
            return get_batch_on_this_cp_rank(batch)
        return dict(get_batch_on_this_cp_rank(packed_batch(batch)), attention_mask=None)

    out = {}
    with megatron_cpu():
        try:
            for tp, cp, layout in configs:
                initialize_context_parallel(RingConfig(context_parallel_size=cp, layout=layout),
                                            tensor_model_parallel_size=tp, seq_length=m["seq"])
                tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
                model = W._build(m, tp, cp, ring=True)
                res = _train(model, m, steps, shard, reduce)
                out[f"tp{tp}cp{cp}-{layout}"] = res if rank == 0 else dict(losses=res["losses"])
                if packed:  # without use_layout_rope, Megatron's per-document RoPE split is refused (rope_guard.py)
                    bare = W._build(m, tp, cp, ring=True, layout_rope=False)
                    mb = shard(doc_batch(m, 0, m["micro_batch"]))
                    try:
                        bare(mb["tokens"], mb["position_ids"], None, labels=mb["labels"],
                             packed_seq_params=mb["packed_seq_params"])
                        out[f"tp{tp}cp{cp}-{layout}"]["refused"] = None
                    except ContextParallelConfigError as e:
                        out[f"tp{tp}cp{cp}-{layout}"]["refused"] = str(e)
                destroy_context_parallel(destroy_model_parallel=True)
            return out
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()


def packed_attention_worker(rank: int, world: int, layout: str) -> dict:
    """RingDotProductAttention with Megatron's PackedSeqParams (THD, padded variants) at CP = world:
    worst error / derived bound (tests/helpers/numerics.py) vs the float64 per-document reference over real
    tokens, for outputs and input gradients."""
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.reference import doc_attention_reference, documents_and_filler
    from megatron_ring import shard_sequence
    from megatron_ring.megatron import (RingConfig, RingDotProductAttention, destroy_context_parallel, initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu
    from tests.helpers.numerics import max_err, score_bound, tol
    from tests.helpers.reference import outputs_and_grads

    errs = {}
    with megatron_cpu():
        try:
            initialize_context_parallel(RingConfig(context_parallel_size=world, layout=layout),
                                        tensor_model_parallel_size=1, seq_length=16 * world)
            for window in (None, (5, 0)):
                cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                        context_parallel_size=world, use_cpu_initialization=True,
                                        attention_dropout=0.0, window_size=window)
                attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
                T = 16 * world
                lens = [1, 7, 3, T // 2 - 3, 2]
                padded_lens = [x + (x % 2) for x in lens]  # per-document filler, as Megatron pads
                cu = torch.tensor([0] + lens).cumsum(0).int()
                cup = torch.tensor([0] + padded_lens).cumsum(0).int()
                assert int(cup[-1]) <= T
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup,
                                         max_seqlen_q=max(padded_lens), max_seqlen_kv=max(padded_lens))
                g = torch.Generator().manual_seed(5)
                q, dout = (torch.randn(T, 4, 8, generator=g).double() for _ in range(2))  # fp32 values
                k, v = (torch.randn(T, 2, 8, generator=g).double() for _ in range(2))
                real = torch.cat([torch.arange(int(a), int(a) + n) for a, n in zip(cup[:-1], lens)])
                ref_cu = documents_and_filler(cup, lens)  # documents and filler as the reference sees them
                ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, ref_cu, True, window), q, k, v,
                                        dout)
                local = [shard_sequence(t, 0, layout=layout).float() for t in (q, k, v, dout)]
                got = outputs_and_grads(lambda a, b, c: attn(a.unsqueeze(1), b.unsqueeze(1), c.unsqueeze(1), None,
                                                             packed_seq_params=params).view(a.shape),
                                        *local)
                pos = shard_sequence(torch.arange(T), 0, layout=layout)
                keep = torch.isin(pos, real)
                sigma = score_bound(q, k)
                errs[str(window)] = max(
                    max_err(a[keep], shard_sequence(r, 0, layout=layout)[keep])
                    / tol(r.abs().max().item(), dtype=torch.float32, n=T, sigma=sigma, blocks=2 * world)
                    for a, r in zip(got, ref))
            return errs
        finally:
            destroy_context_parallel()
