"""Packed documents (THD), sliding windows and padding vs an independent float64 per-document reference.

For every P in {1, 2, 3, 4, 8} one set of gloo processes runs the whole matrix (every layout, causal and
not, random document lengths including 1, documents longer than a shard, end padding, windows smaller
than a zigzag chunk and larger than a shard, with and without documents, MHA/GQA/MQA, fp32 and bf16,
flash and math kernels) and compares outputs AND dq/dk/dv.

Tolerances: the derived bound of tests/helpers/numerics.py (docs/numerics.md, "Test tolerances"), with
the reference fed the same dtype-rounded inputs (so only the ring's arithmetic is measured). A wrong mask
gives O(1) errors.
"""
import itertools
import random

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.reference import doc_attention_reference
from tests.helpers.numerics import Checks, max_err, score_bound, tol
from megatron_ring import ring_attention, shard_sequence
from tests.helpers.reference import outputs_and_grads

pytestmark = pytest.mark.slow  # every test here starts worker processes

HEADS = [(4, 4), (4, 2), (4, 1)]


def _configs(world, seed):
    """(name, T, cu_seqlens or None, window) — T = 12 * world tokens (a shard is 12, a zigzag chunk 6)."""
    rnd = random.Random(seed)
    T = 12 * world
    cu = [0]
    while cu[-1] < T - 3:  # random lengths, length 1 included, then 1-3 padding tokens at the end
        cu.append(min(T - 1, cu[-1] + rnd.choice([1, 1, 2, 3, 5, 7, 13, 17])))
    long_doc = [0, 1, min(T - 2, 1 + 12 + 5)] + ([T - 2] if T - 2 > 18 else [])  # longer than a shard
    return [
        ("random docs + padding", T, cu, None),
        ("long doc + padding", T, long_doc, None),
        ("docs + window<chunk", T, cu, (2, 1)),
        ("window>shard", T, None, (17, 3)),
        ("docs + window>shard", T, long_doc, (14, 0)),
    ]


def _case(world, layout, causal, name, T, cu, window, heads, dtype, kernel, seed, **ring_kw):
    h, h_kv = heads
    d = 16
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(T, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(T, h_kv, d, generator=g).to(dtype) for _ in range(2))
    ref_cu = cu if cu is not None else [0, T]
    ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, ref_cu, causal, window),
                            q.double(), k.double(), v.double(), dout.double())
    local = [shard_sequence(t, 0, layout=layout) for t in (q, k, v, dout)]
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None

    def run(qq, kk, vv):
        out = ring_attention(qq, kk, vv, qkv_format="thd", cu_seqlens=cu_t, causal=causal, layout=layout,
                             window=window, kernel=kernel, **ring_kw)
        assert out.shape == qq.shape and out.dtype == dtype
        return out

    got = outputs_and_grads(run, *local)
    errs = []
    sigma = score_bound(q, k)
    for what, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        errs.append((what, max_err(a, shard_sequence(r, 0, layout=layout)),
                     tol(r.abs().max().item(), dtype=dtype, n=max(T, d), sigma=sigma, blocks=2 * world)))
    return errs


def _matrix_worker(rank, world):
    rows = []
    configs = _configs(world, seed=world)
    cases = itertools.product(("contiguous", "zigzag", "striped"), (True, False), range(len(configs)))
    for i, (layout, causal, ci) in enumerate(cases):  # dtypes alternate: each (layout, config) gets both
        dtype = (torch.float32, torch.bfloat16)[(i + ci) % 2]
        name, T, cu, window = configs[ci]
        heads = HEADS[i % len(HEADS)]
        kernel = "math" if i % 5 == 0 else "auto"
        for what, err, bound in _case(world, layout, causal, name, T, cu, window, heads, dtype, kernel, seed=i):
            rows.append(((layout, causal, name, cu, window, heads, str(dtype), kernel, what), err, bound))
    return rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_documents_and_windows_match_reference(world):
    checks = Checks(f"documents P={world}")
    for rows in run_distributed(_matrix_worker, world, timeout=420):
        checks.extend(rows)
    checks.check(min_rows=3 * 2 * 5 * 4 * world)


def _aligned_window_worker(rank, world):
    """Windows whose edges fall on the default tiles (T = 128 * world: 64-row tiles), so the band's
    lower edge runs as reversed-causal tasks: every layout, causal and not, with documents, fp32/bf16."""
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.schedules.masks import AttentionMask, schedule

    T = 128 * world
    cases = [(True, None, (64, -1)), (False, None, (128, 64)), (True, [0, 64, 65, T - 8], (64, -1))]
    rows, reversed_tasks = [], 0
    for i, (layout, (causal, cu, window)) in enumerate(itertools.product(("contiguous", "zigzag", "striped"),
                                                                          cases)):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        rule = AttentionMask(causal, tuple(cu) if cu else None, window)
        reversed_tasks += sum(getattr(t, "reversed", False) for src in range(world)
                              for t in schedule(get_layout(layout), rule, world, rank, src, T // world))
        for what, err, bound in _case(world, layout, causal, "aligned window", T, cu, window, (4, 2), dtype, "auto",
                                      seed=i):
            rows.append(((layout, causal, cu, window, str(dtype), what), err, bound))
    return rows, reversed_tasks


@pytest.mark.parametrize("world", [2])
def test_tile_aligned_windows_match_reference(world):
    checks = Checks(f"aligned windows P={world}")
    results = run_distributed(_aligned_window_worker, world, timeout=300)
    for rows, _ in results:
        checks.extend(rows)
    checks.check(min_rows=3 * 3 * 4 * world)
    assert all(n > 0 for _, n in results)  # the reversed-causal path really ran on every rank


def _bshd_window_worker(rank, world):
    """A window on bshd/sbhd (batch 2): each batch row is one 'document' of the reference."""
    errs = []
    for layout, fmt, causal in itertools.product(("zigzag", "striped"), ("bshd", "sbhd"), (True, False)):
        g = torch.Generator().manual_seed(3)
        b, S, h, d = 2, 8 * world, 2, 16
        q, dout = (torch.randn(b, S, h, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, S, h, d, generator=g, dtype=torch.float64) for _ in range(2))
        q, k, v, dout = (t.float().double() for t in (q, k, v, dout))  # the reference sees the fp32 inputs
        window = (5, 2)
        ref = [torch.stack(x) for x in zip(*[outputs_and_grads(
            lambda *t: doc_attention_reference(*t, [0, S], causal, window), q[i], k[i], v[i], dout[i])
            for i in range(b)])]
        to_fmt = (lambda t: t) if fmt == "bshd" else (lambda t: t.transpose(0, 1).contiguous())
        local = [to_fmt(shard_sequence(t, 1, layout=layout)).float() for t in (q, k, v, dout)]
        got = outputs_and_grads(lambda *t: ring_attention(*t, causal=causal, layout=layout, qkv_format=fmt,
                                                          window=window), *local)
        sigma = score_bound(q, k)
        for what, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
            errs.append(((layout, fmt, causal, what), max_err(a, to_fmt(shard_sequence(r, 1, layout=layout))),
                         tol(r.abs().max().item(), dtype=torch.float32, n=max(S, d), sigma=sigma)))
    return errs


def _strategies_worker(rank, world):
    """Documents and windows through every comm type (the strategies consume the same masked schedule)."""
    from megatron_ring.strategies import make_hierarchical_groups

    groups = make_hierarchical_groups(2)
    rows = []
    configs = _configs(world, seed=7)
    for i, (comm_type, layout, causal, ci) in enumerate(itertools.product(
            ("all_gather", "a2a", "a2a+p2p"), ("zigzag", "striped", "contiguous"), (True, False), (0, 2, 4))):
        name, T, cu, window = configs[ci]
        kw = {"comm_type": comm_type}
        if comm_type == "a2a+p2p":
            kw["hierarchical_groups"] = groups
        for what, err, bound in _case(world, layout, causal, name, T, cu, window, (4, 2), torch.float32, "auto",
                                      seed=i, **kw):
            rows.append(((comm_type, layout, causal, name, what), err, bound))
    return rows


def test_documents_and_windows_every_comm_type():
    checks = Checks("documents every comm type")
    for rows in run_distributed(_strategies_worker, 4, timeout=420):
        checks.extend(rows)
    checks.check(min_rows=4 * 3 * 3 * 2 * 3 * 4)


@pytest.mark.parametrize("world", [3])
def test_window_on_bshd_and_sbhd(world):
    checks = Checks(f"bshd window P={world}")
    for rows in run_distributed(_bshd_window_worker, world, timeout=300):
        checks.extend(rows)
    checks.check(min_rows=world * 8 * 4)


def _bad_cu_worker(rank, world):
    """cu_seqlens that differ across ranks raise the same ValueError on every rank (no hang)."""
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3 + rank, 8 * world], dtype=torch.int32)
    try:
        ring_attention(q, q, q, qkv_format="thd", cu_seqlens=cu, causal=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_cu_seqlens_differing_across_ranks_is_caught():
    msgs = run_distributed(_bad_cu_worker, 2, timeout=120)
    assert all("cu_seqlens" in m and "differ" in m for m in msgs), msgs
