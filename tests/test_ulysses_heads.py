"""Ulysses (a2a, a2a+p2p) when heads are few: the CP size exceeds or does not divide the (K/V) heads.

The head-split rule (``core/heads.head_split``; docs/strategies.md, "Heads") is checked by brute force
for every small (h, h_kv, P): the query heads split as evenly as they go, each rank receives exactly the
K/V heads its query heads use (never one more on the wire), no balanced contiguous split needs fewer,
and the runs of even GQA grouping map every query head to its own K/V head. Then every case runs on gloo against
the float64 full-attention reference (outputs AND dq/dk/dv; the derived bound of tests/helpers/numerics.py,
which one-process SDPA in the same dtype meets too), over the three layouts, causal
and not, bshd/sbhd, fp32 (and bf16 for some), a2a at P=2, 3, 4 and a2a+p2p over hierarchical groups
(2x2, and 4x2 at P=8), while the bytes each K/V all-to-all puts on the wire are counted and compared
with the rule's. Fewer query heads than ranks raises ``HeadSplitError`` on every rank.
Cases where a rank's heads are not one even GQA grouping (12/3 at P=4, 6/3 at 2x2, 12/3 at 4x2) run the
engine once per run of even grouping (``HeadSplit.runs``).
"""
import itertools

import pytest
import torch

import megatron_ring.strategies.a2a as a2a_mod
from tests.helpers.launch import run_distributed
from megatron_ring import HeadSplitError, ring_attention
from megatron_ring.core.heads import head_split
from megatron_ring.strategies import make_hierarchical_groups
from megatron_ring.planning.cost_model import Machine, Problem, candidate_types, predict
from tests.test_ring_attention import _case_errors


def _compositions(h, world):
    lo, extra = divmod(h, world)
    for big in itertools.combinations(range(world), extra):
        yield [lo + (j in big) for j in range(world)]


def _kv_used(a, b, g):
    return {q // g for q in range(a, b)}


@pytest.mark.parametrize("world", range(1, 9))
def test_head_split_rule_is_exact_and_minimal(world):
    for h in range(world, 13):
        for h_kv in (x for x in range(1, h + 1) if h % x == 0):
            sp = head_split(h, h_kv, world)
            g = h // h_kv
            sizes = [s.stop - s.start for s in sp.q]
            assert sp.q[0].start == 0 and sp.q[-1].stop == h and all(
                a.stop == b.start for a, b in zip(sp.q, sp.q[1:])), sp
            assert max(sizes) - min(sizes) <= 1, sp  # as even as it goes
            for j in range(world):
                used = _kv_used(sp.q[j].start, sp.q[j].stop, g)
                assert set(range(sp.kv[j].start, sp.kv[j].stop)) == used, (sp, j)  # exactly the K/V heads used
                runs = sp.runs(j)  # even GQA groupings covering the rank's heads, in order
                nq, nk = sp.q[j].stop - sp.q[j].start, sp.kv[j].stop - sp.kv[j].start
                assert runs[0][0].start == 0 and runs[-1][0].stop == nq and runs[0][1].start == 0 and \
                    runs[-1][1].stop == nk and len(runs) <= 3, (sp, j, runs)
                for (qs, ks), (qn, kn) in zip(runs, runs[1:]):
                    assert qs.stop == qn.start and ks.stop == kn.start
                for qs, ks in runs:
                    u = (qs.stop - qs.start) // (ks.stop - ks.start)
                    assert u * (ks.stop - ks.start) == qs.stop - qs.start, (sp, j, runs)
                    for i in range(qs.start, qs.stop):  # every query head meets its own K/V head
                        assert sp.kv[j].start + ks.start + (i - qs.start) // u == (sp.q[j].start + i) // g
            # no other balanced contiguous split needs fewer K/V heads (largest count, then the total)
            best = min((max(c), sum(c)) for c in (
                [len(_kv_used(sum(s[:j]), sum(s[:j + 1]), g)) for j in range(world)]
                for s in _compositions(h, world)))
            mine = [s.stop - s.start for s in sp.kv]
            assert (max(mine), sum(mine)) == best, (sp, best)
            assert sp.shared == (sum(mine) > h_kv)


def test_head_split_refuses_fewer_heads_than_ranks():
    with pytest.raises(HeadSplitError, match="at least one head"):
        head_split(4, 4, 8)
    with pytest.raises(HeadSplitError, match="a2a\\+p2p"):
        head_split(2, 1, 4)
    assert issubclass(HeadSplitError, ValueError)


def test_cost_model_counts_the_split():
    """auto / the planner see a2a whenever h >= P; bytes and compute follow the split's per-rank counts."""
    assert "a2a" in candidate_types(6, 4, None) and "a2a" not in candidate_types(4, 8, None)
    assert "a2a+p2p" in candidate_types(3, 4, 2) and "a2a+p2p" not in candidate_types(3, 8, 4)
    m = Machine(flops=1e12, bw_intra=1e10, latency=0.0, overlap=0.0)
    b, S, d, world = 1, 4096, 64, 4
    c = S // world
    for h, h_kv in ((8, 2), (6, 2), (12, 3), (5, 1), (8, 8)):
        pb = Problem(batch=b, seq=S, heads=h, kv_heads=h_kv, head_dim=d, causal=False, elem_bytes=2)
        sp = head_split(h, h_kv, world)
        q = [s.stop - s.start for s in sp.q]
        kv = [s.stop - s.start for s in sp.kv]
        wide = sp.shared
        sent = max(4 * (h - q[j]) * c * d * 2 + (sum(kv) - kv[j]) * c * d * 2 * (2 + (4 if wide else 2))
                   for j in range(world))
        r = predict("a2a", pb, world, m)
        assert r["bytes_per_rank"] == pytest.approx(sent), (h, h_kv)
        flops = 4 * b * max(q) * d * S * S  # the largest head slice over the whole (non-causal) sequence
        assert r["fwd_s"] >= flops / m.flops
    even = predict("a2a", Problem(batch=1, seq=S, heads=8, kv_heads=2, head_dim=d, causal=False), world, m)
    uneven = predict("a2a", Problem(batch=1, seq=S, heads=6, kv_heads=2, head_dim=d, causal=False), world, m)
    assert uneven["fwd_s"] == pytest.approx(even["fwd_s"], rel=0.05)  # 6 heads over 4: the slowest holds 2, as 8/4


A2A = {  # world -> (h, h_kv, d, fmt) for comm_type='a2a'
    2: [(12, 3, 8, "bshd"), (3, 1, 8, "sbhd")],
    3: [(4, 2, 8, "bshd"), (6, 2, 8, "sbhd"), (7, 7, 8, "bshd")],
    4: [(8, 2, 8, "bshd"), (8, 1, 8, "sbhd"), (6, 2, 8, "bshd"), (12, 3, 8, "sbhd"), (5, 1, 8, "bshd"),
        (6, 6, 8, "bshd"), (4, 4, 8, "sbhd")],
}
HIER = {  # world -> (inner, heads) for comm_type='a2a+p2p'
    4: (2, [(6, 3, 8, "bshd"), (3, 1, 8, "sbhd"), (8, 2, 8, "bshd"), (5, 5, 8, "sbhd")]),
    8: (4, [(6, 2, 8, "bshd"), (12, 3, 8, "sbhd")]),
}


def _counting_all_to_all(log):
    real = a2a_mod.all_to_all

    def wrapped(out, inp, over, what, in_splits=None, out_splits=None):
        log.append((what, inp.numel() * inp.element_size(), None if in_splits is None else list(in_splits)))
        return real(out, inp, over, what, in_splits, out_splits)
    return wrapped


def _worker(rank, world, cases, inner, dtypes):
    hier = make_hierarchical_groups(inner) if inner else None
    ct = "a2a+p2p" if inner else "a2a"
    n = inner or world
    me = rank % n
    log = []
    a2a_mod.all_to_all = _counting_all_to_all(log)
    rows, wire = [], []
    combos = itertools.product(cases, ("contiguous", "zigzag", "striped"), (False, True), dtypes)
    for i, (heads, layout, causal, dtype) in enumerate(combos):
        if dtype is torch.bfloat16 and (layout, causal) != ("zigzag", True):
            continue
        log.clear()
        for name, err, sdpa_err, bound in _case_errors(world, layout, causal, heads, dtype, 300 + i, comm_type=ct,
                                                       hierarchical_groups=hier):
            rows.append((ct, heads, layout, causal, str(dtype), name, err, bound))
            rows.append((ct, heads, layout, causal, str(dtype), name + " (sdpa)", sdpa_err, bound))
        # K/V all-to-all: exactly the K/V heads each rank needs (b=2, local length 6 per shard, K and V)
        h, h_kv, d, _ = heads
        sp = head_split(h, h_kv, n)
        elem = torch.empty(0, dtype=dtype).element_size()
        want = [2 * (s.stop - s.start) * 2 * 6 * d * elem for s in sp.kv]
        got = [x for x in log if x[0] == "all-to-all of K/V"]
        wire.append((heads, got[0][2] if got else None, [w // elem for w in want],
                     got[0][1] if got else None, sum(want)))
    return rows, wire, me


def _check(per_rank):
    failures = []
    for rows, wire, _ in per_rank:
        for ct, heads, layout, causal, dtype, name, err, bound in rows:
            if not err <= bound:
                failures.append(f"{ct} {heads} {layout} causal={causal} {dtype} {name}: {err:.3g} > {bound:.3g}")
        for heads, splits, want_splits, nbytes, want_bytes in wire:
            if splits != want_splits or nbytes != want_bytes:
                failures.append(f"{heads}: K/V all-to-all sent {splits} ({nbytes} B), the rule says "
                                f"{want_splits} ({want_bytes} B)")
    assert not failures, "\n".join(failures[:20])
    return sum(len(r) for r, _, _ in per_rank)


def _rows_expected(world, cases, dtypes):
    """Rows ``_check`` must see: per rank, case, layout, causal (bf16: zigzag causal only) out/dq/dk/dv, ring and
    SDPA each."""
    return world * len(cases) * (3 * 2 + (torch.bfloat16 in dtypes)) * 4 * 2


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(A2A))
def test_a2a_with_few_heads_matches_full_attention(world):
    dtypes = (torch.float32, torch.bfloat16)
    assert _check(run_distributed(_worker, world, A2A[world], None, dtypes, timeout=300)) == \
        _rows_expected(world, A2A[world], dtypes)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(HIER))
def test_a2a_p2p_with_few_heads_matches_full_attention(world):
    inner, cases = HIER[world]
    dtypes = (torch.float32, torch.bfloat16) if world == 4 else (torch.float32,)
    assert _check(run_distributed(_worker, world, cases, inner, dtypes, timeout=600)) == \
        _rows_expected(world, cases, dtypes)


def _swapped_kv_worker(rank, world):
    """The same comparison with a broken a2a: the K/V all-to-all's received sequence shards swapped."""
    real = a2a_mod.all_to_all

    def swapped(out, inp, over, what, in_splits=None, out_splits=None):
        pending = real(out, inp, over, what, in_splits, out_splits)
        if what != "all-to-all of K/V":
            return pending

        class Swapped:
            def wait(self):
                pending.wait()
                out.copy_(torch.cat(out.chunk(world)[::-1]))
        return Swapped()
    a2a_mod.all_to_all = swapped
    return _case_errors(world, "zigzag", True, (4, 2, 8, "bshd"), torch.float32, 7, comm_type="a2a")


@pytest.mark.slow
def test_a2a_comparison_sees_a_broken_all_to_all():
    """Negative control: K/V shards of the wrong ranks (sequence order broken) fail the float64 bound by far."""
    for rows in run_distributed(_swapped_kv_worker, 2, timeout=120):
        errs = {name: (err, bound) for name, err, _, bound in rows}
        print({k: f"{e:.3g} > {b:.3g}" for k, (e, b) in errs.items()})
        assert errs["out"][0] > 100 * errs["out"][1] and errs["dk"][0] > 100 * errs["dk"][1], errs


def _refusal_worker(rank, world):
    out = {}
    hier = make_hierarchical_groups(2)
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 1, 8)
    for name, fn in {"a2a": lambda: ring_attention(q, kv, kv, comm_type="a2a"),
                     "a2a+p2p": lambda: ring_attention(q[:, :, :1], kv, kv, comm_type="a2a+p2p",
                                                       hierarchical_groups=hier)}.items():
        try:
            fn()
            out[name] = "no error"
        except HeadSplitError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.slow
def test_too_few_heads_raises_head_split_error_on_every_rank():
    for msgs in run_distributed(_refusal_worker, 4, timeout=120):
        assert "3 query heads over 4 ranks" in msgs["a2a"], msgs
        assert "1 query heads over 2 ranks" in msgs["a2a+p2p"] and "a2a+p2p" in msgs["a2a+p2p"], msgs
