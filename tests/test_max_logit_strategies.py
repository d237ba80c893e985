"""``return_max_logit`` on every comm type (p2p, all_gather, a2a, a2a+p2p, auto) vs the float64 reference.

Gloo processes (slow). Every comm type must give each rank the max over ITS OWN queries' visible pairs for
every query head of its q (a2a computes a slice of heads over the whole sequence and sends each rank its
rows' maxima home; see docs/model_features.md, "QK-clip"); a negative control: the max over the whole
sequence (what a2a holds before sending rows home) misses the bound on some rank under a causal mask.
"""
import itertools

import pytest
import torch

from megatron_ring import ring_attention, shard_sequence
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.launch import run_distributed
from tests.helpers.numerics import Checks, max_logit_tol, score_bound
from tests.helpers.reference import max_logit_reference
from tests.test_strategies import _types, hierarchical

pytestmark = pytest.mark.slow  # worker processes


def _worker(rank, world):
    rows, misses = [], 0
    hier = {inner: hierarchical(world, inner) for _, inner in _types(world) if inner}
    feats = (dict(causal=True), dict(causal=False), dict(causal=True, window=(3, -1)),
             dict(causal=True, thd=True, cu_seqlens=[0, 3 * world, 10 * world, 14 * world]))
    cases = itertools.product(_types(world), ("contiguous", "zigzag", "striped"), feats,
                              ((2 * world, 2 * world), (2 * world, world), (world, 1)))
    for i, ((ct, inner), layout, feat, (h, h_kv)) in enumerate(cases):
        feat = dict(feat)
        thd = feat.pop("thd", False)
        S, d = 16 * world, 16
        g = torch.Generator().manual_seed(1000 + i)
        q = torch.randn(1 if thd else 2, S, h, d, generator=g)
        k, v = (torch.randn(q.shape[0], S, h_kv, d, generator=g) for _ in range(2))
        local = [shard_sequence(t, 1, layout=layout) for t in (q, k, v)]
        if thd:
            local = [t[0] for t in local]
        _, ml = ring_attention(*local, layout=layout, comm_type=ct, hierarchical_groups=hier.get(inner),
                               qkv_format="thd" if thd else "bshd", return_max_logit=True, **feat)
        pos = get_layout(layout).positions(S, world, rank)
        ref = max_logit_reference(q, k, causal=feat["causal"], cu=feat.get("cu_seqlens"), window=feat.get("window"))
        want = ref[:, pos].amax(1)
        assert torch.equal(torch.isneginf(want), torch.isneginf(ml.double())), (ct, ml, want)
        bound = max_logit_tol(sigma=score_bound(q, k), d=d)
        err = (ml.double() - want).abs().nan_to_num(posinf=0.0).max().item()
        rows.append(((ct, inner, layout, sorted(feat), h, h_kv), err, bound))
        if feat == {"causal": True}:  # control: the whole sequence's max (no rows sent home)
            misses += int((ml.double() - ref.amax(1)).abs().max().item() > bound)
    return rows, misses


@pytest.mark.parametrize("world", [2, 4])
def test_every_comm_type(world):
    checks, misses, seen = Checks(f"max_logit strategies P={world}"), 0, set()
    for rows, m in run_distributed(_worker, world, timeout=600):
        checks.extend(rows)
        misses += m
        seen |= {key[0] for key, _, _ in rows}
    checks.check()
    assert {"p2p", "all_gather", "a2a", "auto"} | ({"a2a+p2p"} if world == 4 else set()) <= seen
    assert misses > 0, "the whole-sequence max passed the per-rank comparison: the control has no power"


def _refusal_worker(rank, world):
    """Rank 1's q is refused on that rank only (a non-contiguous head dim) with return_max_logit on: every rank
    raises (the refused rank runs the max logit's exchange too, no hang), and the next call works."""
    out = {}
    hier = hierarchical(world, 2) if world == 4 else None
    for ct in ("p2p", "all_gather", "a2a") + (("a2a+p2p",) if hier else ()):
        q = torch.randn(1, 16, 4, 8)
        kv = torch.randn(1, 16, 2, 8)
        kw = dict(causal=True, comm_type=ct, hierarchical_groups=hier, return_max_logit=True, timeout_s=20.0)
        ring_attention(q, kv, kv, **kw)  # the signature seen
        bad = torch.randn(1, 16, 4, 16)[..., ::2] if rank == 1 else q
        try:
            ring_attention(bad, kv, kv, **kw)
            out[ct] = "no error"
        except ValueError as exc:
            out[ct] = type(exc).__name__
        _, ml = ring_attention(q, kv, kv, **kw)
        out[ct + " after"] = tuple(ml.shape)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_refused_rank_takes_part_in_the_max_exchange(world):
    for rank, out in enumerate(run_distributed(_refusal_worker, world, timeout=240)):
        for ct, got in out.items():
            if ct.endswith("after"):
                assert got == (4,), (rank, ct, got)
            else:
                assert got != "no error", (rank, ct)
