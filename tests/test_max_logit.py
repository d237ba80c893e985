"""``ring_attention(..., return_max_logit=True)`` (QK-clip) vs the float64 max of the visible scores.

P ranks of the ring run as P threads of this process (``tests.helpers.ring_fakes.run_threads``): the real engine,
codecs and pieces, no processes. Each rank's ``max_logit [h]`` must equal, within the derived bound
(``numerics.max_logit_tol``), the float64 max over its own queries' visible pairs
(``reference.max_logit_reference``), for every layout, format (bshd, sbhd, thd with documents), causal,
window, GQA/MQA, MLA head dims, sinks, head chunks, K/V pieces and wire. Negative controls: a max that ignores
the mask, and one taken over the rank's own K/V block only, miss the same bound. The other comm types (which
need process groups) are in tests/test_max_logit_strategies.py.
"""
import itertools

import pytest
import torch

from megatron_ring import RingInputError, ring_attention
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.schedules.masks import DocumentZigzag
from megatron_ring.wire.codecs import KVSpec, make_codec
from tests.helpers.numerics import Checks, max_logit_tol, score_bound
from tests.helpers.reference import max_logit_reference
from tests.helpers.ring_fakes import run_threads


def _inputs(b, S, h, h_kv, d, dtype, seed, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, S, h, d, generator=g).to(dtype)
    k = torch.randn(b, S, h_kv, d, generator=g).to(dtype)
    v = torch.randn(b, S, h_kv, dv or d, generator=g).to(dtype)
    return q, k, v


def _positions(layout, S, world, rank):
    return get_layout(layout).positions(S, world, rank) if isinstance(layout, str) else layout.positions(S, world, rank)


def _run(q, k, v, world, *, layout="zigzag", fmt="bshd", **kw):
    """Per rank: ``(max_logit, positions)`` from ``ring_attention`` on ``world`` thread ranks."""
    S = q.shape[1]

    def body(rank, ring):
        pos = _positions(layout, S, world, rank)
        if fmt == "thd":
            local = [t[0].index_select(0, pos) for t in (q, k, v)]
        else:
            local = [t.index_select(1, pos) for t in (q, k, v)]
            if fmt == "sbhd":
                local = [t.transpose(0, 1).contiguous() for t in local]
        out, ml = ring_attention(*local, ring=ring, layout=layout, qkv_format=fmt, return_max_logit=True, **kw)
        assert ml.shape == (q.shape[2],) and ml.dtype == torch.float32 and not ml.requires_grad
        return ml, pos

    results = run_threads(body, world)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _compare(checks, label, results, ref_rows, bound):
    """Each rank's max_logit vs the max of its positions' reference rows (-inf where a head sees nothing:
    then both must be -inf)."""
    for rank, (ml, pos) in enumerate(results):
        want = ref_rows[:, pos].amax(1)
        both_inf = torch.isneginf(want) & torch.isneginf(ml.double())
        assert torch.equal(torch.isneginf(want), torch.isneginf(ml.double())), (label, rank, ml, want)
        err = (ml.double() - want).abs().masked_fill(both_inf, 0.0)
        checks.add(f"{label} rank {rank}", float("inf") if torch.isnan(err).any() else err.max().item(), bound)


def _finite_max(ref_rows) -> float:
    """The largest |reference max logit| (rows that see nothing excluded)."""
    return ref_rows[torch.isfinite(ref_rows)].abs().max().item()


def _misses(results, ref_rows, bound) -> bool:
    """Negative control: some rank's max_logit is NOT within ``bound`` of the max of these (wrong) rows."""
    return any((ml.double() - ref_rows[:, pos].amax(1)).abs().max().item() > bound for ml, pos in results)


LAYOUTS = ("contiguous", "zigzag", "striped")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_formats_gqa(world):
    """Every layout x causal x bshd/sbhd x MHA/GQA/MQA, fp32 and bf16, P = 1, 2, 4."""
    checks = Checks(f"max_logit P={world}")
    cases = itertools.product(LAYOUTS, (False, True), ("bshd", "sbhd"), ((4, 4), (4, 2), (4, 1)),
                              (torch.float32, torch.bfloat16))
    for i, (layout, causal, fmt, (h, h_kv), dtype) in enumerate(cases):
        q, k, v = _inputs(2, 8 * world, h, h_kv, 16, dtype, seed=i)
        ref = max_logit_reference(q, k, causal=causal)
        bound = max_logit_tol(sigma=score_bound(q, k), d=16, dtype=dtype, ref_max=_finite_max(ref))
        _compare(checks, (layout, causal, fmt, h, h_kv, dtype), _run(q, k, v, world, layout=layout, fmt=fmt,
                                                                      causal=causal), ref, bound)
    checks.check(min_rows=world * 72)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_documents_windows_sinks_mla(world):
    """thd documents (padding at the end), windows with and without causal, sinks (not a logit: a huge sink
    changes nothing), MLA (d_v != d_qk), DocumentZigzag."""
    checks = Checks(f"max_logit features P={world}")
    S, h, h_kv, d = 16 * world, 4, 2, 16
    cu = [0, 3 * world, 9 * world, 14 * world]  # the last 2P tokens are padding: they see nothing
    cases = [
        dict(layout="zigzag", fmt="thd", causal=True, cu_seqlens=cu),
        dict(layout="striped", fmt="thd", causal=False, cu_seqlens=cu, window=(3, 2)),
        dict(layout="contiguous", fmt="bshd", causal=True, window=(5, -1)),
        dict(layout="zigzag", fmt="sbhd", causal=False, window=(2, 4)),
        dict(layout="zigzag", fmt="bshd", causal=True, softmax_offset=torch.full((h,), 100.0)),
        dict(layout="striped", fmt="bshd", causal=True, softmax_offset=0.0, dv=24),
        dict(layout="zigzag", fmt="thd", causal=True, cu_seqlens=cu, dv=8, window=(4, -1)),
        dict(layout=DocumentZigzag([0, 4 * world, 16 * world]), fmt="thd", causal=True,
             cu_seqlens=[0, 4 * world, 16 * world]),
    ]
    for i, case in enumerate(cases):
        case = dict(case)
        dv, fmt, layout = case.pop("dv", None), case.pop("fmt"), case.pop("layout")
        b = 1 if fmt == "thd" else 2
        q, k, v = _inputs(b, S, h, h_kv, d, torch.float32, seed=100 + i, dv=dv)
        ref = max_logit_reference(q, k, causal=case["causal"], cu=case.get("cu_seqlens"), window=case.get("window"))
        bound = max_logit_tol(sigma=score_bound(q, k), d=d)
        _compare(checks, (i, fmt, sorted(case)), _run(q, k, v, world, layout=layout, fmt=fmt, **case), ref, bound)
    checks.check(min_rows=world * len(cases))


@pytest.mark.parametrize("world", [2, 4])
def test_head_chunks_pieces_dropout(world):
    """Head chunks and K/V pieces (each piece of heads folds into its own heads' rows) and dropout (the
    max is of the logits before dropout)."""
    checks = Checks(f"max_logit chunks P={world}")
    q, k, v = _inputs(2, 8 * world, 8, 4, 16, torch.float32, seed=7)
    ref = max_logit_reference(q, k, causal=True)
    bound = max_logit_tol(sigma=score_bound(q, k), d=16)
    for kw in (dict(head_chunks=2), dict(kv_pieces=4), dict(head_chunks=2, kv_pieces=2),
               dict(dropout_p=0.3, dropout_seed=11)):
        _compare(checks, sorted(kw.items()), _run(q, k, v, world, causal=True, **kw), ref, bound)
    checks.check(min_rows=4 * world)


def test_row_chunks(monkeypatch):
    """A block larger than the pass's score budget runs a few query rows at a time (a triangle's chunks read
    only the keys they may see): the same max, for full, causal, reversed (a window's lower edge) and masked
    tasks."""
    import megatron_ring.core.max_logit as ml

    monkeypatch.setattr(ml, "BUDGET", 64)  # 1 to 2 query rows per chunk at these sizes
    checks = Checks("max_logit row chunks")
    q, k, v = _inputs(2, 128, 4, 2, 16, torch.float32, seed=13)
    # contiguous, window (64, -1): rank 1 sees rank 0's block as an exact reversed triangle
    for case in (dict(causal=True), dict(causal=False, window=(3, 5)), dict(causal=True, window=(64, -1))):
        ref = max_logit_reference(q, k, causal=case["causal"], window=case.get("window"))
        _compare(checks, sorted(case), _run(q, k, v, 2, layout="contiguous", **case), ref,
                 max_logit_tol(sigma=score_bound(q, k), d=16))
    checks.check(min_rows=6)


def _ramp(S, sign):
    """q, k (fp32, d = 2) whose score is ``sign * (i - j)``: it grows away from the query on one side, so the
    largest score of a row sits on a mask edge and the first hidden pair beyond it is larger by exactly 1."""
    pos = torch.arange(S, dtype=torch.float32)
    q = torch.stack([sign * pos, torch.ones(S)], -1).view(1, S, 1, 2)
    k = torch.stack([torch.ones(S), -sign * pos], -1).view(1, S, 1, 2)
    return q, k, torch.randn(1, S, 1, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_mask_edges_exact(world):
    """Scores that grow beyond each mask edge: one pair too many or too few on any edge (causal diagonal, window
    sides, document bounds, padding; every task kind, row chunks of one row) moves the max by 1, far above the
    bound. A random input's max is insensitive to a single edge pair; this one is not."""
    import megatron_ring.core.max_logit as ml

    checks, S = Checks(f"max_logit mask edges P={world}"), 32 * world
    cu = [0, 5 * world, 19 * world, 30 * world]
    cases = [dict(causal=True), dict(causal=True, window=(16 * world, -1)), dict(causal=False, window=(7, 5)),
             dict(causal=False, window=(-1, 9)), dict(causal=True, fmt="thd", cu_seqlens=cu),
             dict(causal=False, fmt="thd", cu_seqlens=cu, window=(4, 6))]
    saved = ml.BUDGET
    try:
        for budget in (saved, 8):  # 8: one query row per chunk
            ml.BUDGET = budget
            for layout, case, sign in itertools.product(LAYOUTS, cases, (1.0, -1.0)):
                case = dict(case)
                fmt = case.pop("fmt", "bshd")
                q, k, v = _ramp(S, sign)
                ref = max_logit_reference(q, k, causal=case["causal"], cu=case.get("cu_seqlens"),
                                          window=case.get("window"), scale=1.0)
                _compare(checks, (budget, layout, fmt, sorted(case.items()), sign),
                         _run(q, k, v, world, layout=layout, fmt=fmt, softmax_scale=1.0, **case), ref,
                         max_logit_tol(sigma=score_bound(q, k, 1.0), d=2))
    finally:
        ml.BUDGET = saved
    checks.check(min_rows=2 * len(LAYOUTS) * len(cases) * 2 * world)


def _wire_round_trip(k, v, comm_dtype, world, layout, rank):
    """K as rank ``rank``'s kernels see it: its own block as is, every other rank's decoded from the wire."""
    S = k.shape[1]
    codec = make_codec(comm_dtype, k.dtype)
    seen = k.clone()
    for src in range(world):
        if src == rank:
            continue
        pos = _positions(layout, S, world, src)
        kb, vb = (t.index_select(1, pos).transpose(1, 2).contiguous() for t in (k, v))
        spec = KVSpec(tuple(kb.shape), tuple(vb.shape), kb.dtype, kb.device)
        buf = codec.new_buffer(spec)
        codec.encode(kb, vb, buf)
        seen[:, pos] = codec.decode(buf, spec)[0].transpose(1, 2)
    return seen


@pytest.mark.parametrize("comm_dtype", ["bf16", "fp8"])
def test_wire_codecs(comm_dtype):
    """A lossy wire: the max of the decoded K's scores (the K the kernel sees), per rank."""
    world, layout = 4, "zigzag"
    checks = Checks(f"max_logit wire {comm_dtype}")
    q, k, v = _inputs(2, 8 * world, 4, 2, 16, torch.float32, seed=3)
    results = _run(q, k, v, world, layout=layout, causal=True, comm_dtype=comm_dtype)
    bound = max_logit_tol(sigma=score_bound(q, k), d=16)
    for rank in range(world):
        seen = _wire_round_trip(k, v, comm_dtype, world, layout, rank)
        _compare(checks, rank, [results[rank]], max_logit_reference(q, seen, causal=True), bound)
    checks.check(min_rows=world)
    # the wire's rounding is visible: the undecoded K's max misses the bound on some rank
    assert _misses(results, max_logit_reference(q, k, causal=True), bound)


@pytest.mark.parametrize("world", [2, 4])
def test_negative_controls(world):
    """A max over masked pairs, or over the rank's own K/V block only, misses the bound the real max meets."""
    q, k, v = _inputs(2, 8 * world, 4, 2, 16, torch.float32, seed=5)
    bound = max_logit_tol(sigma=score_bound(q, k), d=16)
    results = _run(q, k, v, world, causal=True, window=(3, -1))
    checks = Checks("max_logit control")
    _compare(checks, "window", results, max_logit_reference(q, k, causal=True, window=(3, -1)), bound)
    checks.check()
    assert _misses(results, max_logit_reference(q, k, causal=True, window=(3, -1), visible_only=False), bound)
    assert _misses(results, max_logit_reference(q, k, causal=False, window=None), bound)
    # only the local block: the reference with every other rank's keys hidden
    full = _run(q, k, v, world, causal=False)
    local_only = [(ml, pos) for ml, pos in full]
    own = torch.stack([max_logit_reference(q[:, pos], k[:, pos], causal=False)[:, :].amax(1)
                       for _, pos in local_only])
    got = torch.stack([ml.double() for ml, _ in local_only])
    assert ((got - own).abs() > bound).any(), "a local-only max would pass"


def test_flag_off_is_bit_identical_and_on_changes_no_output():
    """Off: the default call, nothing computed; on: the output (and its gradients) are the same bits."""
    q, k, v = _inputs(2, 32, 4, 2, 16, torch.bfloat16, seed=9)

    def body(rank, ring):
        pos = _positions("zigzag", 32, 2, rank)
        got = []
        for flag in (False, True):
            leaves = [t.index_select(1, pos).clone().requires_grad_() for t in (q, k, v)]
            res = ring_attention(*leaves, ring=ring, causal=True, return_max_logit=flag)
            out = res[0] if flag else res
            out.float().square().sum().backward()
            got.append([out.detach()] + [t.grad for t in leaves])
        return all(torch.equal(a, b) for a, b in zip(*got))

    assert run_threads(body, 2) == [True, True]


def test_bad_flag_refused():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="return_max_logit"):
        ring_attention(q, q, q, return_max_logit="yes")


@pytest.mark.parametrize("world", [1, 3])
def test_max_logit_rows_count_the_marked_rows_only(world):
    """``max_logit_rows``: the max over the marked local query rows only (the glue passes the real tokens of
    Megatron's padded packed documents); against the reference rows of those positions; negative control: the max
    over every row misses (the unmarked rows hold the largest logits); a mask of the wrong length is refused on
    every rank by name."""
    S = 8 * world
    q, k, v = _inputs(1, S, 4, 2, 16, torch.float32, seed=3)
    marked = torch.arange(S) % 3 != 0
    q[:, ~marked] *= 10.0  # the unmarked rows' logits are the largest
    ref = max_logit_reference(q, k, causal=True)
    bound = max_logit_tol(sigma=score_bound(q, k), d=16, ref_max=_finite_max(ref))

    def body(rank, ring, rows_of=lambda pos: marked[pos]):
        pos = _positions("zigzag", S, world, rank)
        local = [t.index_select(1, pos) for t in (q, k, v)]
        _, ml = ring_attention(*local, ring=ring, causal=True, return_max_logit=True, max_logit_rows=rows_of(pos))
        return ml, pos

    results = run_threads(body, world)
    for rank, (ml, pos) in enumerate(results):
        want = ref[:, pos].masked_fill(~marked[pos], float("-inf")).amax(1)
        assert (ml.double() - want).abs().max().item() <= bound, (rank, ml, want)
        assert (ml.double() - ref[:, pos].amax(1)).abs().max().item() > bound  # every row: another max
    bad = run_threads(lambda rank, ring: body(rank, ring, lambda pos: marked[pos][1:] if rank == 0 else marked[pos]),
                      world)
    assert isinstance(bad[0], ValueError) and "max_logit_rows" in str(bad[0]), bad
    assert all(isinstance(r, RingInputError) for r in bad[1:]), bad  # every other rank: the named refusal
