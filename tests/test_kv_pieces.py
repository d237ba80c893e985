"""Sub-block streaming (``kv_pieces``): K/V and dK/dV travel in pieces of K/V heads through n + 1 slots.

Every piece count must give the float64 reference's outputs and gradients (every layout, GQA, MLA
head dims, batch > 1, bf16, documents + windows with a shortened ring, dropout), the returned dK/dV
must be views of the travelling accumulator (no copy), and the piece count must be a function of
shapes and device type only (every rank gets the same)."""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.reference import feature_reference
from tests.helpers.numerics import Checks, max_err, score_bound, tol
from megatron_ring import ring_attention, settings, shard_sequence
from megatron_ring.core.rotation import (AUTO_PIECES_CPU, CPU_MIN_PIECE_WORK, CUDA_MIN_TILES, divisor_at_most, piece_count, start_for)

# vs the float64 reference fed the same dtype-rounded inputs: the derived bound of tests/helpers/numerics.py
# (a wrong piece, slot or hop: O(0.1..1) x max |reference| errors)


def _rows(got, ref, layout, dim, *, dtype, n, sigma, blocks, runs=1):
    """(name, max error, derived bound) for out, dq, dk, dv."""
    return [(name, max_err(a, shard_sequence(r, dim, layout=layout)),
             tol(r.abs().max().item(), dtype=dtype, n=n, sigma=sigma, blocks=blocks, runs=runs))
            for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref)]


def _case(rank, world, *, layout, causal, pieces, b, h, h_kv, d, dv, dtype, fmt="bshd", cu=None, window=None,
          dropout_p=0.0, seed=None, head_chunks=1):
    g = torch.Generator().manual_seed(11)
    S = 8 * world
    shape = lambda hh, dd: (b, S, hh, dd)  # noqa: E731
    q, k, v, dout = (torch.randn(*shape(*hd), generator=g, dtype=torch.float64).to(dtype).double()
                     for hd in ((h, d), (h_kv, d), (h_kv, dv), (h, dv)))  # the reference sees the rounded inputs
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = feature_reference(*leaves, causal=causal, cu=cu, window=window, dropout_p=dropout_p, seed=seed)
    ref_out.backward(dout)
    ref = [ref_out.detach()] + [t.grad for t in leaves]
    if fmt == "thd":  # b == 1: [t, h, d]
        local = [shard_sequence(t[0], 0, layout=layout).to(dtype).requires_grad_() for t in (q, k, v)]
        ldout = shard_sequence(dout[0], 0, layout=layout).to(dtype)
        ref = [r[0] for r in ref]
        dim = 0
    else:
        local = [shard_sequence(t, 1, layout=layout).to(dtype).requires_grad_() for t in (q, k, v)]
        ldout = shard_sequence(dout, 1, layout=layout).to(dtype)
        dim = 1
    out = ring_attention(*local, causal=causal, layout=layout, kv_pieces=pieces, qkv_format=fmt,
                         cu_seqlens=torch.tensor(cu) if cu is not None else None, window=window,
                         dropout_p=dropout_p, dropout_seed=seed, head_chunks=head_chunks)
    out.backward(ldout)
    got = [out.detach()] + [t.grad for t in local]
    return _rows(got, ref, layout, dim, dtype=dtype, n=max(S, d, dv), sigma=score_bound(q, k),
                 blocks=2 * world), got


def _exact_worker(rank, world):
    errs = []
    for layout, causal, pieces in itertools.product(("zigzag", "striped", "contiguous"), (True, False), (1, 2, 3, 4)):
        for b, h, h_kv, d, dv, dtype in ((2, 8, 4, 16, 16, torch.float32), (1, 6, 6, 12, 8, torch.float32),
                                         (1, 4, 4, 16, 16, torch.bfloat16)):
            rows, _ = _case(rank, world, layout=layout, causal=causal, pieces=pieces, b=b, h=h, h_kv=h_kv, d=d,
                            dv=dv, dtype=dtype)
            key = (layout, causal, pieces, b, h, h_kv, dv, str(dtype))
            errs += [(key + (name,), e, bound) for name, e, bound in rows]
    return errs


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_every_piece_count_is_exact(world):
    """Pieces 1-4 (3 rounds down to a divisor of the K/V heads), GQA with batch 2, MLA head dims
    (d_v != d_qk), bf16; every layout, causal and not; outputs and all three gradients."""
    checks = Checks(f"kv_pieces P={world}")
    for per_rank in run_distributed(_exact_worker, world, timeout=600):
        checks.extend(per_rank)
    checks.check(min_rows=world * 3 * 2 * 4 * 3 * 4)


def _masks_worker(rank, world):
    S = 8 * world
    errs = []
    cu = [0, 5, 5 + 3 * world, S - 2, S]
    for layout, pieces, window in itertools.product(("zigzag", "contiguous"), (1, 2, 4), ((3, -1), (-1, -1))):
        rows, _ = _case(rank, world, layout=layout, causal=True, pieces=pieces, b=1, h=4, h_kv=4, d=8, dv=8,
                        dtype=torch.float32, fmt="thd", cu=cu, window=None if window == (-1, -1) else window)
        errs += [((layout, pieces, window, name), e, bound) for name, e, bound in rows]
    # a window that shortens the ring (contiguous: only the previous rank's keys are in reach)
    for pieces in (1, 2, 4):
        rows, _ = _case(rank, world, layout="contiguous", causal=True, pieces=pieces, b=1, h=4, h_kv=4, d=8, dv=8,
                        dtype=torch.float32, window=(5, -1))
        errs += [(("contiguous short ring", pieces, name), e, bound) for name, e, bound in rows]
    return errs


@pytest.mark.slow
def test_pieces_with_documents_windows_and_a_shortened_ring():
    checks = Checks("kv_pieces masks")
    for per_rank in run_distributed(_masks_worker, 4, timeout=600):
        checks.extend(per_rank)
    checks.check(min_rows=4 * (12 + 3) * 4)


def _dropout_worker(rank, world):
    res = {}
    for pieces in (1, 2, 4):
        rows, got = _case(rank, world, layout="zigzag", causal=True, pieces=pieces, b=1, h=8, h_kv=4, d=8, dv=8,
                          dtype=torch.float32, dropout_p=0.3, seed=1234, head_chunks=2 if pieces == 4 else 1)
        res[pieces] = (rows, got)
    out = []
    base_rows, base = res[1]
    for pieces, (rows, got) in res.items():
        out += [((pieces, name, "ref"), e, bound) for name, e, bound in rows]
        # two runs, each within the bound of the same reference: within twice it of each other
        out += [((pieces, name, "vs pieces=1"), max_err(a, b), 2 * bound)
                for (name, _, bound), a, b in zip(base_rows, got, base)]
    return out


@pytest.mark.slow
def test_dropout_does_not_depend_on_pieces():
    """Position-keyed dropout is the same decision whatever the pieces (and head chunks): the results
    match the reference and each other."""
    checks = Checks("kv_pieces dropout")
    for rows in run_distributed(_dropout_worker, 3, timeout=600):
        checks.extend(rows)
    checks.check(min_rows=3 * 3 * 8)


def _views_worker(rank, world):
    from megatron_ring.transport.ring import Ring
    from megatron_ring.core.plan import RingPlan
    from megatron_ring.core.engine import ring_backward, ring_forward
    from megatron_ring.wire.codecs import make_codec
    from megatron_ring.kernels.block import select_kernel
    from megatron_ring.schedules.layouts import get_layout

    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    ring = Ring(torch.distributed.group.WORLD, q.device)
    plan = RingPlan(ring=ring, layout=get_layout("zigzag"), causal=True, scale=0.25,
                    kernel=select_kernel(q, "auto"), codec=make_codec(None, q.dtype), pieces=4)
    out, lse = ring_forward(q, k, v, plan)
    dq, dk, dv = ring_backward(torch.randn_like(out), q, k, v, out, lse, plan)
    return dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr(), dk.shape == k.shape


@pytest.mark.slow
def test_returned_dk_dv_are_views_of_the_accumulator():
    """After P hops the pieces sit in slots 0..n-1 in order: dK and dV are views, never copies."""
    for shared, shaped in run_distributed(_views_worker, 3, timeout=120):
        assert shared and shaped


def test_piece_count_rules(monkeypatch):
    monkeypatch.delenv("MEGATRON_RING_KV_PIECES", raising=False)
    big = (4096, 128, "cpu")  # s, d: 32 * 4096^2 * 128 = 2^36 work, room for 16 pieces
    assert piece_count(1, 32, 8, *big) == min(8, AUTO_PIECES_CPU)
    assert piece_count(1, 32, 16, *big) == AUTO_PIECES_CPU
    assert piece_count(1, 8, 1, *big) == 1  # MQA: one K/V head, one piece
    # CPU: at least CPU_MIN_PIECE_WORK per piece (small problems: the rendezvous per piece would show)
    assert piece_count(1, 8, 8, 8192, 64, "cpu") == 8 * 8192 ** 2 * 64 // CPU_MIN_PIECE_WORK == 8
    assert piece_count(1, 8, 8, 4096, 64, "cpu") == 2
    assert piece_count(1, 8, 8, 2048, 64, "cpu") == 1  # S=8192 at P=4: whole blocks
    assert piece_count(2, 8, 8, 4096, 64, "cpu") == 4  # batch rows are work too
    # CUDA: at least CUDA_MIN_TILES (query head x 128 rows) tiles per piece
    assert piece_count(1, 32, 8, 2048, 128, "cuda") == 1  # 32 * 16 = 512 tiles: one piece
    assert piece_count(1, 32, 8, 16384, 128, "cuda") == (32 * 128) // CUDA_MIN_TILES
    assert piece_count(1, 32, 8, *big, requested=3) == 3  # the engine rounds down to a divisor
    assert divisor_at_most(8, 3) == 2 and divisor_at_most(6, 4) == 3 and divisor_at_most(5, 4) == 1
    # the variable is read once per call, by ring_attention (megatron_ring.settings), not by piece_count
    monkeypatch.setenv("MEGATRON_RING_KV_PIECES", "2")
    assert piece_count(1, 32, 8, *big) == 8 and piece_count(1, 32, 8, *big, requested=settings.kv_pieces()) == 2
    monkeypatch.setenv("MEGATRON_RING_KV_PIECES", "two")
    with pytest.raises(ValueError, match="MEGATRON_RING_KV_PIECES"):
        settings.kv_pieces()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="kv_pieces"):
            piece_count(1, 32, 8, *big, requested=bad)
    # the slots start so that after `steps` rotations the pieces are in slots 0..n-1
    for n, steps in itertools.product((1, 2, 4, 8), (1, 2, 3, 4, 7)):
        assert (start_for(n, steps) - steps) % (n + 1) == 0


def test_bad_kv_pieces_names_the_argument():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="kv_pieces"):
        ring_attention(q, q, q, kv_pieces=0)


def test_head_chunks_is_a_deprecated_alias_that_still_runs_exactly():
    """``head_chunks`` warns, naming ``kv_pieces``, and runs as ``kv_pieces`` at the same count: bit for bit the
    same outputs and gradients (also on a P = 2 loopback ring, where the pieces stream), within the fp32 bound of
    the float64 reference; ignored when ``kv_pieces`` is given; the default (1) does not warn."""
    from megatron_ring.transport.ring import LoopbackRing
    import warnings

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 32, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(1, 32, 4, 8, generator=g, dtype=torch.float64)

    def run(ring=None, **kw):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*x, causal=True, kernel="math", ring=ring, **kw)
        return (out, *torch.autograd.grad(out, x, dout))

    with pytest.warns(FutureWarning, match=r"head_chunks=n\) is deprecated: it runs as kv_pieces=n"):
        old = run(head_chunks=2)
    for ring in (None, LoopbackRing(2, 1, torch.device("cpu"))):
        with pytest.warns(FutureWarning):
            alias, ignored = run(ring, head_chunks=2), run(ring, head_chunks=2, kv_pieces=1)
        pieces, one = run(ring, kv_pieces=2), run(ring, kv_pieces=1)
        assert all(torch.equal(a, b) for a, b in zip(alias, pieces)) and all(torch.equal(a, b) for a, b in zip(ignored, one))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # negative control: neither the default nor kv_pieces warns
        new, whole = run(kv_pieces=2), run()
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (x[0], x[1].repeat_interleave(2, 2), x[2].repeat_interleave(2, 2))),
        is_causal=True).transpose(1, 2)
    ref = (ref_out, *torch.autograd.grad(ref_out, x, dout))
    sigma = score_bound(q, k)  # the math kernel accumulates in fp32: the fp32 bound of tests/helpers/numerics.py
    for a, b, w, r in zip(old, new, whole, ref):
        bound = tol(r.abs().max().item(), dtype=torch.float32, n=32, sigma=sigma, blocks=2)
        assert max_err(a, r) <= bound and max_err(b, r) <= bound and max_err(w, r) <= bound, (max_err(a, r), bound)
