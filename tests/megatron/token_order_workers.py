"""Workers for tests/megatron/test_token_order.py (gloo processes; tests/dist_utils.py)."""
from __future__ import annotations

import torch


def stock_packed_attention_worker(rank: int, world: int, comm_type: str) -> dict:
    """RingDotProductAttention as the stock ``--spec`` builds it (``batch_split="megatron"``) fed a packed
    THD batch split the way Megatron splits it (per-document zigzag, TransformerEngine's order; here the
    pure-torch partitioner), at CP = world: worst error / derived bound (tests/helpers/numerics.py) over real
    tokens vs the float64 per-document reference, outputs and input gradients."""
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.numerics import max_err, score_bound, tol
    from tests.helpers.reference import doc_attention_reference, documents_and_filler, outputs_and_grads
    from megatron_ring.megatron import (RingConfig, RingDotProductAttention, destroy_context_parallel,
                                        initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu
    from megatron_ring.megatron.data.token_order import thd_get_partitioned_indices

    errs = {}
    with megatron_cpu():
        try:
            initialize_context_parallel(RingConfig(context_parallel_size=world, layout="zigzag",
                                                   cp_comm_type=comm_type), tensor_model_parallel_size=1)
            for window in (None, (5, 0)):
                cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                        context_parallel_size=world, use_cpu_initialization=True,
                                        attention_dropout=0.0, window_size=window)
                attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self", batch_split="megatron")
                lens = [1, 7, 3, 2 * world + 3, 0, 2]
                padded = [-(-n // (2 * world)) * 2 * world for n in lens]
                cu = torch.tensor([0] + lens).cumsum(0).int()
                cup = torch.tensor([0] + padded).cumsum(0).int()
                T = int(cup[-1])
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup,
                                         max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
                g = torch.Generator().manual_seed(5)
                q, dout = (torch.randn(T, 4, 8, generator=g).double() for _ in range(2))  # fp32 values
                k, v = (torch.randn(T, 2, 8, generator=g).double() for _ in range(2))
                real = torch.cat([torch.arange(int(a), int(a) + n) for a, n in zip(cup[:-1], lens)])
                ref_cu = documents_and_filler(cup, lens)  # documents and filler as the reference sees them
                ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, ref_cu, True, window), q, k, v, dout)
                idx = thd_get_partitioned_indices(cup, T, world, rank).long()  # Megatron's split
                local = [t.index_select(0, idx).float() for t in (q, k, v, dout)]
                got = outputs_and_grads(lambda a, b, c: attn(a.unsqueeze(1), b.unsqueeze(1), c.unsqueeze(1), None,
                                                             packed_seq_params=params).view(a.shape), *local)
                keep = torch.isin(idx, real)
                sigma = score_bound(q, k)
                errs[str(window)] = max(
                    max_err(a[keep], r.index_select(0, idx)[keep])
                    / tol(r.abs().max().item(), dtype=torch.float32, n=T, sigma=sigma, blocks=2 * world)
                    for a, r in zip(got, ref))
            return errs
        finally:
            destroy_context_parallel()


def stock_stream_split_attention_worker(rank: int, world: int, announce: str) -> float:
    """RingDotProductAttention as the stock ``--spec`` builds it, fed a packed batch that Megatron-LM's own
    ``get_batch_on_this_cp_rank(use_per_sequence_balancing=True)`` split (``--dataloader-inter-document-masking``:
    ONE zigzag over the stream, unpadded documents, odd lengths), at CP = world. ``announce``: what Megatron-LM's
    arguments say (``"inter-document"``: the flag set, as stock ``pretrain_hybrid.py`` runs; ``"sft"``: the
    negative control, the arguments announce the per-document split although the batch was cut as one sequence;
    documents then a multiple of 2 x CP long, so that the per-document order is defined and merely wrong).
    Returns the worst error / derived bound over outputs and input gradients vs the float64 reference."""
    torch.set_num_threads(1)
    from types import SimpleNamespace

    import megatron.training.global_vars as gv
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_batch_on_this_cp_rank

    from tests.helpers.numerics import max_err, score_bound, tol
    from tests.helpers.reference import doc_attention_reference, outputs_and_grads
    from megatron_ring.megatron import (RingConfig, RingDotProductAttention, destroy_context_parallel,
                                        initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu

    lens = [1, 7, 3, 2 * world + 3, 2] if announce == "inter-document" else [2 * world, 6 * world, 4 * world]
    lens[-1] += -sum(lens) % (2 * world)  # Megatron-LM: the stream (micro-batch x seq-length) is a multiple of 2 x CP
    cu = torch.tensor([0] + lens).cumsum(0).int()
    T = int(cu[-1])
    saved = gv._GLOBAL_ARGS
    with megatron_cpu():
        try:
            gv._GLOBAL_ARGS = SimpleNamespace(dataloader_inter_document_masking=announce == "inter-document",
                                              sft=announce == "sft", position_embedding_type="none")
            initialize_context_parallel(RingConfig(context_parallel_size=world, layout="zigzag"),
                                        tensor_model_parallel_size=1)
            cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                    context_parallel_size=world, use_cpu_initialization=True, attention_dropout=0.0)
            attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self", batch_split="megatron")
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            batch = {"tokens": torch.arange(T)[None], "cu_seqlens": cu[None], "cu_seqlens_padded": None}
            idx = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group(),
                                            use_per_sequence_balancing=True)["tokens"][0]  # Megatron's own split
            g = torch.Generator().manual_seed(7)
            q, dout = (torch.randn(T, 4, 8, generator=g).double() for _ in range(2))  # fp32 values
            k, v = (torch.randn(T, 2, 8, generator=g).double() for _ in range(2))
            ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, cu.tolist(), True), q, k, v, dout)
            local = [t.index_select(0, idx).float() for t in (q, k, v, dout)]
            got = outputs_and_grads(lambda a, b, c: attn(a.unsqueeze(1), b.unsqueeze(1), c.unsqueeze(1), None,
                                                         packed_seq_params=params).view(a.shape), *local)
            sigma = score_bound(q, k)
            return max(max_err(a, r.index_select(0, idx)) / tol(r.abs().max().item(), dtype=torch.float32, n=T,
                                                                  sigma=sigma, blocks=2 * world)
                       for a, r in zip(got, ref))
        finally:
            gv._GLOBAL_ARGS = saved
            destroy_context_parallel()
