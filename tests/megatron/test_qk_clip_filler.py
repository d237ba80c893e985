"""QK-clip's max logit on packed documents padded by Megatron (``cu_seqlens_q_padded``) counts the real tokens only.

The ring gives the filler of each padded document attention of its own (a document of its own: its rows are no
token of the data, their loss is masked); before, ``RingDotProductAttention.current_max_attn_logits`` included the
logits of filler attending to filler, so QK-clip could clip the weights for pad tokens' activations. Now the glue
passes the rows of real tokens (``documents.real_rows``) as ``max_logit_rows``. Checked at CP = 1 and 2 (the ring's
own split and Megatron's per-document one) against the float64 max over the real tokens' causal pairs; the filler
is scaled up so that a max that counts it misses (the negative control: ``real_rows`` answering None, every row)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import max_logit_tol, score_bound
from tests.megatron.conftest import RUN_TIMEOUT

pytestmark = pytest.mark.slow  # worker processes


def worker(rank: int, world: int, megatron_split: bool, count_filler: bool = False) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ring import DocumentZigzag, get_layout
    from megatron_ring.megatron import (RingConfig, RingDotProductAttention, destroy_context_parallel,
                                        initialize_context_parallel)
    from megatron_ring.megatron.attention import module as glue
    from megatron_ring_lab.cpu import megatron_cpu

    if count_filler:
        glue.real_rows = lambda *a: None
    with megatron_cpu():
        initialize_context_parallel(RingConfig(context_parallel_size=world))
        try:
            cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                                    kv_channels=8, context_parallel_size=world, use_cpu_initialization=True,
                                    log_max_attention_logit=True, attention_dropout=0.0)
            attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                           batch_split="megatron" if megatron_split else "ring")
            lens, padded_lens = [3, 6, 1], [4, 8, 4]  # padded to multiples of 2 x CP (CP <= 2)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            cup = torch.tensor([0, *torch.tensor(padded_lens).cumsum(0).tolist()], dtype=torch.int32)
            T = int(cup[-1])
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
                                     cu_seqlens_kv_padded=cup, max_seqlen_q=8, max_seqlen_kv=8)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(T, 2, 8, generator=g) for _ in range(3))
            k, v = k[:, :1], v[:, :1]
            real = torch.zeros(T, dtype=torch.bool)
            for a, n in zip(cup[:-1].tolist(), lens):
                real[a:a + n] = True
            q[~real] *= 20.0  # filler activations (pad-token embeddings) can be anything
            k[~real] *= 20.0
            lay = DocumentZigzag(cup) if megatron_split else get_layout("zigzag")
            pos = lay.positions(T, world, rank)
            attn(q[pos], k[pos], v[pos], None, packed_seq_params=params)
            got = attn.current_max_attn_logits.clone()
            torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MAX)  # what Megatron's clip_qk does
            want = torch.full((2,), float("-inf"), dtype=torch.float64)
            for a, n in zip(cup[:-1].tolist(), lens):  # each real document's causal pairs, float64
                s = torch.einsum("ihd,jd->hij", q[a:a + n].double(), k[a:a + n, 0].double()) / 8 ** 0.5
                s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
                want = torch.maximum(want, s.amax((1, 2)))
            bound = max_logit_tol(sigma=score_bound(q[real], k[real]), d=8, ref_max=float(want.abs().max()))
            return float((got.double() - want).abs().max()), bound, float(want.max())
        finally:
            destroy_context_parallel(destroy_model_parallel=True)


@pytest.mark.parametrize("world,megatron_split", [(1, False), (2, False), (2, True)])
def test_max_logit_counts_the_real_tokens_only(world, megatron_split):
    for err, bound, _ in run_distributed(worker, world, megatron_split, timeout=RUN_TIMEOUT):
        assert err <= bound, (err, bound)


def test_negative_control_counting_the_filler_misses():
    err, bound, _ = run_distributed(worker, 2, False, True, timeout=RUN_TIMEOUT)[0]
    assert err > 10 * bound, (err, bound)
