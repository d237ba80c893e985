"""The math kernels in tiles of query rows (kernels/math_kernel.py ``row_tiles``, ``RowTiled``).

The math kernel (fp32 on CUDA, GPUs before sm80, head dims over 256, masked blocks that fall back) and the torch
dropout kernel materialise a block's fp32 scores. A block whose scores exceed ``score_budget`` elements runs in
tiles of query rows, so no tensor of the call is larger than the budget (or than the inputs), whatever the block.

Checked here on CPU with a small budget: every tile kind (top-left causal square and rectangular both ways, full,
an explicit mask of documents, a window and padding rows that see no key, GQA, MLA head dims), forward and backward
of both kernels against float64 with the same mask (dropout: the same positional keep mask, evaluated once on the
whole block), and the largest tensor any op makes. Negative controls: tiles that lose their row offset fail the
bound; one tile holds the whole block's scores. The whole engine with a small budget:
``test_a_ring_in_tiles_matches_float64``; the CUDA path at real sizes: tests/fake_cuda/test_fallback_memory.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring.kernels import math_kernel
from megatron_ring.kernels.math_kernel import MathKernel, row_tiles
from megatron_ring.kernels.dropout import DropoutKernel, DropoutSpec
from megatron_ring.schedules.masks import AttentionMask, BlockMask
from tests.helpers.numerics import Checks, lse_tol, max_err, score_bound, tol
from tests.helpers.reference import block_reference
from tests.helpers.seen_ops import LargestResult

B, D = 2, 16


def _mask(sq: int, sk: int) -> BlockMask:
    """Documents (boundaries 9, 30 of 34 positions: the last rows are padding, they see no key) with a left window
    of 5, causal; query rows at positions 10.., key rows at 0.. (a visiting block earlier in the stream)."""
    rule = AttentionMask(True, (0, 9, 30), (5, -1))
    qpos, kpos = torch.arange(10, 10 + sq), torch.arange(sk)
    return BlockMask(rule, qpos, rule.doc_ids(qpos), kpos, rule.doc_ids(kpos))


# name: (h, h_kv, sq, sk, d_v, causal, masked)
CASES = {
    "causal square": (4, 4, 24, 24, D, True, False),
    "causal, fewer queries than keys": (4, 2, 16, 24, D, True, False),
    "causal, more queries than keys": (4, 2, 24, 16, D, True, False),
    "full, GQA": (4, 1, 20, 28, D, False, False),
    "full, MLA head dims": (4, 2, 20, 28, 8, False, False),
    "documents, window, padding": (4, 2, 24, 30, D, False, True),
}


def _inputs(h, h_kv, sq, sk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, sq, D, generator=g)
    k = torch.randn(B, h_kv, sk, D, generator=g)
    v = torch.randn(B, h_kv, sk, dv, generator=g)
    dout = torch.randn(B, h, sq, dv, generator=g)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, mask, scale, keep=None, p=0.0):
    """Float64 out, lse, dq, dk, dv of the whole block (the mask from its rule over the whole block, not a tile's)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    visible = mask.allowed() if mask is not None else None
    out, lse = block_reference(*leaves, causal, scale, visible=visible, keep=keep, p=p)
    out.backward(dout.double())
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def _kernel(kind: str, h: int, sq: int, sk: int, budget: int):
    if kind == "math":
        kern = MathKernel()
    else:
        kern = DropoutKernel(DropoutSpec(p=0.3, seed=7, heads=h, seq_len=64))
    kern.score_budget = budget
    return kern


def _run(kern, q, k, v, dout, causal, scale, mask, extra):
    out, lse = kern.forward(q, k, v, causal, scale, mask=mask, **extra)
    grads = kern.backward(dout, q, k, v, out, lse, causal, scale, mask=mask, **extra)
    return out, lse, *grads


def _compare(kind, name, budget, checks=None):
    h, h_kv, sq, sk, dv, causal, masked = CASES[name]
    q, k, v, dout = _inputs(h, h_kv, sq, sk, dv)
    scale = D ** -0.5
    mask = _mask(sq, sk) if masked else None
    causal = causal and mask is None
    kern = _kernel(kind, h, sq, sk, budget)
    extra, keep = {}, None
    if kind == "dropout":
        qpos, kpos = torch.arange(10, 10 + sq), torch.arange(sk)
        extra = dict(qpos=qpos, kpos=kpos)
        keep = kern.spec.keep(B, h, qpos, kpos)  # the whole block's keep mask, once
    ref = _reference(q, k, v, dout, causal, mask, scale, keep, 0.3 if keep is not None else 0.0)
    got = _run(kern, q, k, v, dout, causal, scale, mask, extra)
    checks = checks or Checks(f"row tiles {kind} {name}")
    kw = dict(dtype=torch.float32, n=max(sq, sk, D, dv), sigma=score_bound(q, k, scale))
    for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.shape == r.shape and a.dtype == torch.float32, (what, a.shape, r.shape, a.dtype)
        if what == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isneginf(a), ~fin), "rows that see no key: lse -inf"
            checks.add((name, what), max_err(a[fin], r[fin]), lse_tol(r[fin], **kw))
        else:
            bound = tol(r.abs().max().item(), **kw)
            checks.add((name, what), max_err(a, r), bound)
    return checks, (h, sq, sk)


@pytest.mark.parametrize("kind", ["math", "dropout"])
@pytest.mark.parametrize("name", list(CASES))
def test_tiles_match_float64(kind, name):
    h, _, sq, sk, *_ = CASES[name]
    budget = B * h * sk * 5  # tiles of 5 query rows
    assert len(row_tiles(B, h, sq, sk, False, budget)) > 1
    checks, _ = _compare(kind, name, budget)
    checks.check(min_rows=5)


def test_row_tiles_cover_each_row_once_and_only_the_keys_a_causal_tile_sees():
    for sq, sk, causal in ((24, 24, True), (16, 24, True), (24, 16, True), (20, 28, False), (7, 7, True)):
        for budget in (1, 8, 40, 10**9):
            tiles = row_tiles(1, 2, sq, sk, causal, budget)
            assert [r.start for r, _ in tiles] == sorted(r.start for r, _ in tiles)
            covered = torch.cat([torch.arange(sq)[r] for r, _ in tiles])
            assert torch.equal(covered, torch.arange(sq))
            for rows, keys in tiles:
                assert keys.start == 0
                # a causal tile's rows see keys j <= i < rows.stop: none past it, none of them cut off (one tile:
                # the whole block, as before tiles)
                assert keys.stop == (min(sk, rows.stop) if causal and len(tiles) > 1 else sk)
                assert 2 * (rows.stop - rows.start) * sk <= max(budget, 2 * sk)
    assert row_tiles(1, 2, 24, 24, True, 10**9) == [(slice(0, 24), slice(0, 24))]  # fits: the block, as before


@pytest.mark.parametrize("kind", ["math", "dropout"])
def test_no_tensor_exceeds_the_budget(kind):
    """The largest result of any op in a tiled forward + backward is at most the budget or the largest input /
    gradient; one tile (the budget of the whole block) makes the whole [b, h, sq, sk] scores (the control)."""
    h, h_kv, sq, sk, dv = 2, 1, 64, 64, 8
    q, k, v, dout = _inputs(h, h_kv, sq, sk, dv)
    extra = dict(qpos=torch.arange(sq), kpos=torch.arange(sk)) if kind == "dropout" else {}
    inputs = max(t.numel() for t in (q, k, v, dout))
    budget = B * h * sk * 4  # 4 rows per tile
    seen = {}
    for label, bud in (("tiled", budget), ("one tile", 10**9)):
        kern = _kernel(kind, h, sq, sk, bud)
        with LargestResult() as mode:
            _run(kern, q, k, v, dout, True, 0.25, None, extra)
        seen[label] = mode.elements
    assert seen["tiled"] <= max(budget, inputs), seen
    assert seen["one tile"] >= B * h * sq * sk > max(budget, inputs), seen  # the control: the measure can fail


def test_tiles_that_lose_their_row_offset_fail_the_bound(monkeypatch):
    """Negative control: a tile whose causal rows are numbered from 0 (its offset in the block lost) is over the
    float64 bound, so the bound sees a wrong tile."""
    real = math_kernel.hidden_pairs

    def from_zero(causal, mask, rows, keys, device):
        return real(causal, mask, slice(0, rows.stop - rows.start), keys, device)

    monkeypatch.setattr(math_kernel, "hidden_pairs", from_zero)
    h, _, _, sk, *_ = CASES["causal square"]
    checks, _ = _compare("math", "causal square", B * h * sk * 5)
    assert checks.worst() > 1.0, checks.worst()


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("docs", [False, True])
def test_a_ring_in_tiles_matches_float64(monkeypatch, P, docs):
    """A whole ring (threads, ``kernel="math"``, zigzag) whose every block runs in tiles of a few rows (masked
    tasks of packed documents included) against float64, outputs and gradients, fp32."""
    from megatron_ring.schedules.layouts import get_layout
    from tests.helpers.reference import doc_attention_reference, outputs_and_grads
    from tests.helpers.ring_fakes import thd_ring_in_global_order

    monkeypatch.setattr(MathKernel, "score_budget", 3 * 4 * 8)  # a block of 4 heads x 8 keys: 3 rows per tile
    tiled = []
    real = math_kernel.row_tiles
    monkeypatch.setattr(math_kernel, "row_tiles", lambda *a: (tiled.append(len(t := real(*a))), t)[1])
    T, h, h_kv = 16 * P, 4, 2
    g = torch.Generator().manual_seed(P)
    q = torch.randn(T, h, D, generator=g)
    k, v = (torch.randn(T, h_kv, D, generator=g) for _ in range(2))
    dout = torch.randn(T, h, D, generator=g)
    cu = [0, 5, T // 2 + 3, T - 4] if docs else [0, T]
    got = thd_ring_in_global_order(P, get_layout("zigzag"), q, k, v, dout, causal=True, cu_seqlens=cu,
                                   kernel="math")
    ref = outputs_and_grads(lambda a, b, c: doc_attention_reference(a, b, c, cu, True), q, k, v, dout.double())
    checks = Checks(f"ring in row tiles P={P}")
    kw = dict(dtype=torch.float32, n=max(T, D), sigma=score_bound(q, k), blocks=2 * P)
    for what, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        checks.add((docs, what), max_err(a, r), tol(r.abs().max().item(), **kw))
    checks.check(min_rows=4)
    assert tiled and min(tiled) > 1, tiled  # every block ran in tiles
