"""MLA head dims, attention sinks and positional dropout vs an independent float64 reference.

One set of gloo processes per P in {1, 2, 3, 4} runs the whole matrix (slow tier), and the same matrix runs with
the ranks as threads of one process (a ThreadRing; fast tier, and scripts/numerics_matrix.sh under every CPU
instruction set): every layout, causal and not,
bshd / sbhd / thd (documents + window), MLA head dims (d_qk != d_v, both ways), sinks (off-by-one
float and learnable per-head tensor, whose gradient is summed over the group), dropout (alone, with
sinks, with head_chunks=2, with documents), fp32 and bf16 wire/compute. Outputs AND dq/dk/dv (and the
sink gradient) are compared with the float64 reference; with dropout, CP=P is also compared with the
same call at CP=1 (a loopback ring in the same process): they agree to fp32 rounding.

Tolerances: the derived bound of tests/helpers/numerics.py (docs/numerics.md, "Test tolerances"), the
reference fed the same dtype-rounded inputs; CP=P vs CP=1 within twice it. A wrong mask, sink or dropout
decision gives O(0.1..1) x max |reference| errors.
"""
import math
import threading

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import run_distributed
from tests.helpers.reference import feature_reference, sink_weight
from tests.helpers.numerics import Checks, max_err, score_bound, sink_grad_scale, tol
from tests.helpers.ring_fakes import run_threads
from megatron_ring import ring_attention
from megatron_ring.kernels.dropout import keep_mask
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.transport.ring import LoopbackRing

# (name, dqk, dv, h, h_kv, sink, dropout, head_chunks, fmt, docs, dtype, comm_dtype)
CASES = [
    ("mla 12/8", 12, 8, 4, 2, None, 0.0, 1, "bshd", False, torch.float32, None),
    ("mla 8/12 sbhd", 8, 12, 4, 4, None, 0.0, 1, "sbhd", False, torch.float32, None),
    ("mla bf16 fp8 wire", 12, 8, 4, 1, None, 0.0, 1, "bshd", False, torch.bfloat16, "fp8"),
    ("mla bf16 wire", 12, 8, 4, 2, None, 0.0, 2, "bshd", False, torch.float32, "bf16"),
    ("sink off-by-one", 8, 8, 4, 2, 0.0, 0.0, 1, "bshd", False, torch.float32, None),
    ("sink learnable mla", 12, 8, 4, 2, "learn", 0.0, 2, "sbhd", False, torch.float32, None),
    ("sink learnable docs", 8, 8, 4, 4, "learn", 0.0, 1, "thd", True, torch.float32, None),
    ("sink bf16", 8, 8, 4, 2, "learn", 0.0, 1, "bshd", False, torch.bfloat16, None),
    ("dropout", 8, 8, 4, 2, None, 0.3, 1, "bshd", False, torch.float32, None),
    ("dropout sink chunks mla", 12, 8, 4, 2, "learn", 0.2, 2, "sbhd", False, torch.float32, None),
    ("dropout docs+window", 8, 8, 4, 1, None, 0.25, 1, "thd", True, torch.float32, None),
]


def _global(case, world, seed):
    name, dqk, dv, h, h_kv, sink, p, chunks, fmt, docs, dtype, wire = case
    b = 1 if fmt == "thd" else 2
    S = 8 * world
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, S, h, dqk, generator=g).to(dtype)
    k = torch.randn(b, S, h_kv, dqk, generator=g).to(dtype)
    v = torch.randn(b, S, h_kv, dv, generator=g).to(dtype)
    dout = torch.randn(b, S, h, dv, generator=g).to(dtype)
    sink_t = None
    if sink == "learn":
        sink_t = torch.randn(h, generator=g)
    elif sink is not None:
        sink_t = torch.full((h,), float(sink))
    cu = sorted({0, 3, 4, min(11, S - 3), S - 2}) if docs else None
    window = (5, 2) if docs and p else None
    return q, k, v, dout, sink_t, cu, window, S


def _to_fmt(x, fmt):  # x [b, S, ...] -> local layout of the format
    return x.squeeze(0) if fmt == "thd" else (x.transpose(0, 1).contiguous() if fmt == "sbhd" else x)


def _from_fmt(x, fmt):
    return x.unsqueeze(0) if fmt == "thd" else (x.transpose(0, 1) if fmt == "sbhd" else x)


def _run_ring(case, layout, causal, local, sink_t, cu, window, seed, ring=None):
    name, dqk, dv, h, h_kv, sink, p, chunks, fmt, docs, dtype, wire = case
    leaves = [t.detach().clone().requires_grad_() for t in local[:3]]
    s_leaf = None
    if sink == "learn":
        s_leaf = sink_t.clone().requires_grad_()
        offset = s_leaf
    else:
        offset = None if sink is None else float(sink)
    out = ring_attention(*leaves, causal=causal, layout=layout, qkv_format=fmt, comm_dtype=wire,
                         head_chunks=chunks, softmax_offset=offset, dropout_p=p, dropout_seed=seed,
                         cu_seqlens=torch.tensor(cu) if cu is not None else None, window=window, ring=ring)
    assert out.dtype == dtype and out.shape == (*local[0].shape[:-1], dv)
    out.backward(local[3])
    grads = [t.grad for t in leaves] + ([s_leaf.grad] if s_leaf is not None else [])
    return out.detach(), grads


def _worker(rank, world, ring=None, all_reduce=dist.all_reduce):
    """Every case's rows on ``rank``: over the default process group (gloo), or on ``ring`` (a ThreadRing) with
    ``all_reduce`` summing over its threads."""
    rows = []
    for ci, case in enumerate(CASES):
        name, dqk, dv, h, h_kv, sink, p, chunks, fmt, docs, dtype, wire = case
        for li, layout in enumerate(("contiguous", "zigzag", "striped")):
            for causal in (True, False):
                seed = 1000 * ci + 10 * li + int(causal)
                q, k, v, dout, sink_t, cu, window, S = _global(case, world, seed)
                ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
                s_ref = sink_t.double().requires_grad_() if sink_t is not None else None
                ref = feature_reference(*ref_leaves, causal=causal, cu=cu, window=window, sink=s_ref,
                                        dropout_p=p, seed=seed)
                ref.backward(dout.double())
                refs = [ref.detach()] + [t.grad for t in ref_leaves] + (
                    [s_ref.grad] if sink == "learn" else [])
                pos = get_layout(layout).positions(S, world, rank)
                part = lambda x: x.index_select(1, pos)  # noqa: E731 - this rank's share (shard_sequence's)
                sh = lambda x: _to_fmt(part(x), fmt)  # noqa: E731
                local = [sh(t) for t in (q, k, v, dout)]
                out, grads = _run_ring(case, layout, causal, local, sink_t, cu, window, seed, ring=ring)
                if sink == "learn" and world > 1:
                    all_reduce(grads[3])  # each rank's sink gradient covers its own queries
                got = [out] + grads
                sigma = score_bound(q, k)
                b = q.shape[0]
                mag = {what: r.abs().max().item() for what, r in zip(("out", "dq", "dk", "dv", "dsink"), refs)}
                if "dsink" in mag:  # a signed sum over rows that cancels: M from its terms (helpers.numerics)
                    weight = sink_weight(q, k, sink_t, causal=causal, cu=cu, window=window)
                    mag["dsink"] = max(mag["dsink"], sink_grad_scale(weight, dout, refs[0]))
                for what, a, r in zip(("out", "dq", "dk", "dv", "dsink"), got, refs):
                    r_local = r if what == "dsink" else sh(r)
                    n = b * S if what == "dsink" else max(S, dqk, dv)
                    bound = tol(mag[what], dtype=dtype, n=n, sigma=sigma, wire=wire, blocks=2 * world)
                    rows.append(((name, layout, causal, what, "ref"), max_err(a, r_local), bound))
                if p and world > 1:  # CP=P vs CP=1 (same seed, same call, loopback ring on the full data)
                    full = [_to_fmt(t, fmt) for t in (q, k, v, dout)]
                    out1, grads1 = _run_ring(case, layout, causal, full, sink_t, cu, window, seed,
                                             ring=LoopbackRing(1, 0, q.device))
                    for what, a, r, r64 in zip(("out", "dq", "dk", "dv", "dsink"), got, [out1] + grads1, refs):
                        r_local = r if what == "dsink" else _to_fmt(part(_from_fmt(r, fmt)), fmt)
                        n = b * S if what == "dsink" else max(S, dqk, dv)
                        bound = tol(mag[what], dtype=dtype, n=n, sigma=sigma, wire=wire, runs=2, blocks=2 * world)
                        rows.append(((name, layout, causal, what, "cp1"), max_err(a, r_local), bound))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mla_sinks_dropout_match_reference(world):
    checks = Checks(f"model_features P={world}")
    for rows in run_distributed(_worker, world, timeout=600):
        checks.extend(rows)
    checks.check(min_rows=100 * world)


class _ThreadSum:
    """``all_reduce`` (sum, in place) over the threads of :func:`run_threads`: every thread adds the same parts in
    rank order, so all get the same bits."""

    def __init__(self, world):
        self.parts, self.barrier = [None] * world, threading.Barrier(world)

    def bind(self, rank):
        def all_reduce(t):
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for part in self.parts[1:]:
                total += part
            self.barrier.wait()  # every thread has read every part before one is overwritten
            t.copy_(total)
        return all_reduce


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mla_sinks_dropout_match_reference_on_threads(world):
    """The same matrix with the ranks as threads of one process (a ThreadRing): the kernels' arithmetic in the fast
    tier, and under every CPU instruction set (scripts/numerics_matrix.sh), without processes."""
    checks, total = Checks(f"model_features threads P={world}"), _ThreadSum(world)
    for rows in run_threads(lambda rank, ring: _worker(rank, world, ring, total.bind(rank)), world):
        if isinstance(rows, BaseException):
            raise rows
        checks.extend(rows)
    checks.check(min_rows=100 * world)


def _sink_grad_error(seed, b, S, h, d, dtype, shift=0.0):
    """A learnable sink through a one-process ring (math kernel): (error of its gradient, the bound with M from
    its terms, the bound with M = max |reference| alone); ``shift`` moves the sink the ring is given."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, S, h, d, generator=g).to(dtype) for _ in range(4))
    sink = torch.randn(h, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    s_ref = sink.double().requires_grad_()
    ref = feature_reference(*leaves, causal=False, sink=s_ref)
    ref.backward(dout.double())
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    s_leaf = (sink + shift).requires_grad_()
    out = ring_attention(*x, causal=False, kernel="math", softmax_offset=s_leaf, ring=LoopbackRing(1, 0, q.device))
    out.backward(dout)
    kw = dict(dtype=dtype, n=b * S, sigma=score_bound(q, k), blocks=2)
    m = max(s_ref.grad.abs().max().item(), sink_grad_scale(sink_weight(q, k, sink, causal=False), dout, ref.detach()))
    return max_err(s_leaf.grad, s_ref.grad), tol(m, **kw), tol(s_ref.grad.abs().max().item(), **kw)


def test_a_sink_gradient_that_cancels_is_bounded_by_its_terms(monkeypatch):
    """A learnable sink's gradient is a signed sum over rows. The row-tile fuzz found one (fp32, one query row per
    tile) whose reference cancels to 1/600 of its terms' magnitudes: its error, one fp32 rounding of the terms, was
    over the bound from max |reference| (1.2x) and is far within the bound from its terms (helpers.numerics
    ``sink_grad_scale``). Negative control: a sink shifted by 0.2 is over the bound (fp32: 770x, bf16: 3x)."""
    from megatron_ring.kernels.math_kernel import MathKernel

    monkeypatch.setattr(MathKernel, "score_budget", 2)  # one query row per tile, as the fuzz ran it
    err, bound, from_ref = _sink_grad_error(422948, 2, 22, 1, 5, torch.float32)
    assert err <= bound and bound > 10 * from_ref, (err, bound, from_ref)
    for dtype in (torch.float32, torch.bfloat16):
        err, bound, _ = _sink_grad_error(3, 2, 32, 2, 16, dtype)
        assert err <= bound, (dtype, err, bound)
        err, bound, _ = _sink_grad_error(3, 2, 32, 2, 16, dtype, shift=0.2)
        assert err > bound, (dtype, err, bound)


def test_dropout_rate_and_independence():
    """Drop rate within 5 sigma for p in {0.1, 0.5}; masks of neighbouring heads/rows/seeds independent."""
    pos = torch.arange(512)
    for p in (0.1, 0.5):
        keep = keep_mask(1234, torch.arange(4), pos, pos, p)  # 4 x 512 x 512 = 1M decisions
        n = keep.numel()
        rate = 1.0 - keep.float().mean().item()
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n), (p, rate)
        a, b = keep[0].flatten().float(), keep[1].flatten().float()
        both = (a * b).mean().item()  # P(keep, keep) for two heads = (1-p)^2 if independent
        assert abs(both - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 / a.numel()), (p, both)
        rows = keep[0].float().mean(1)  # per-query rates over 512 keys each: no stuck rows (6 sigma: 512 rows)
        row_sigma = math.sqrt(p * (1 - p) / keep.shape[-1])
        assert rows.min() > 1 - p - 6 * row_sigma and rows.max() < 1 - p + 6 * row_sigma, (p, rows.min(), rows.max())
        other = keep_mask(1235, torch.arange(4), pos, pos, p)
        agree = (other == keep).float().mean().item()
        expect = p * p + (1 - p) ** 2
        assert abs(agree - expect) < 5 * math.sqrt(expect * (1 - expect) / n), (p, agree, expect)


def test_bad_feature_arguments_name_the_fix():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="dropout_seed"):
        ring_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        ring_attention(q, q, q, dropout_p=1.0, dropout_seed=1)
    with pytest.raises(ValueError, match=r"shape \[h\]"):
        ring_attention(q, q, q, softmax_offset=torch.zeros(3))
    with pytest.raises(ValueError, match="softmax_offset"):
        ring_attention(q, q, q, softmax_offset=float("nan"))


def test_breakdown_records_every_phase_and_is_off_by_default():
    from megatron_ring import breakdown

    q = torch.randn(1, 32, 2, 8, requires_grad=True)
    with breakdown.record() as rec:
        ring_attention(q, q, q, causal=True, ring=LoopbackRing(2, 0, q.device)).backward(torch.ones(1, 32, 2, 8))
    cats = {(phase, cat) for phase, _, cat in rec}
    assert {("fwd", "kernel"), ("fwd", "merge"), ("bwd", "kernel"), ("bwd", "copies")} <= cats, cats
    assert all(v >= 0 for v in rec.values())
    assert breakdown.section(0, "kernel") is breakdown.section(1, "merge")  # the shared no-op when not recording


def _mismatch_worker(rank, world):
    q = torch.randn(1, 8, 2, 4)
    try:
        ring_attention(q, q, q, dropout_p=0.1, dropout_seed=rank)  # seeds differ across ranks
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_dropout_seed_differing_across_ranks_is_caught():
    for msg in run_distributed(_mismatch_worker, 2, timeout=120):
        assert "dropout_seed" in msg, msg


def _seed_per_step_worker(rank, world):
    from megatron_ring.core import validation

    gathers = []
    real = validation.dist.all_gather

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    validation.dist.all_gather = counting
    try:
        q = torch.randn(1, 8, 2, 4)
        for seed in (11, 12, 13, 14):  # a new seed every step, as Megatron draws one per layer call
            ring_attention(q, q, q, dropout_p=0.1, dropout_seed=seed)
    finally:
        validation.dist.all_gather = real
    return len(gathers)


@pytest.mark.slow
def test_a_new_dropout_seed_per_call_costs_no_cross_rank_check():
    """The seed is compared with a new signature only (the mismatch test above), so a seed drawn per call
    costs one all_gather for the first call and none after it."""
    assert run_distributed(_seed_per_step_worker, 2, timeout=120) == [1, 1]
