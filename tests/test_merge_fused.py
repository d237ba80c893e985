"""The fused merge (``torch.ops.megatron_ring.merge_``, core/merge.py) against the torch expression.

CPU: the registered op runs the torch expression (bit-equal) and traces under FakeTensorMode as one op.
:func:`check_triton_against_reference` (run by tests/fake_cuda/test_triton_kernels.py, where Triton is installed):
the CUDA kernel of core/merge_triton.py runs on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, read when ``triton.jit`` decorates: the kernel is made afresh under it) against
:func:`merge_reference` within the derived bound below, including rows with no key on either side, fresh
accumulators, row-slice views and strided (BSHD-ordered) accumulators, blk_out in fp32/bf16/fp16 and a head dim
that is not a power of two; a negative control shows the check fails on a wrong merge. The backward's fused adds
(``add_all`` of core/accumulators.py) equal the adds one by one (the list op itself: tests/test_foreach_fused.py).

The bound: both sides compute the same fp32 terms (max, two exp, one reciprocal, two products and a sum);
each op adds at most one rounding of the fp32 unit roundoff ``u`` and exp/log implementations differ by at
most 2 ``u`` (the weights are <= 1), so an output element differs by at most ``8 u (|acc| + |blk|)`` and an lse
by at most ``8 u (|m| + 1)`` (``log(total)``, total in [1, 2]). -inf lse and the zero rows must match exactly.
"""
from __future__ import annotations

import torch

from megatron_ring.core.merge import merge_into, merge_reference

U32 = torch.finfo(torch.float32).eps / 2
NEG = float("-inf")


def _inputs(dtype=torch.bfloat16, d: int = 12, seed: int = 0):
    """An accumulator ``[2, 3, 9, d]`` (BSHD memory order) with -inf rows, a block with -inf rows (some
    overlapping: rows with no key on either side)."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(2, 9, 3, d, generator=g).permute(0, 2, 1, 3)  # strided, as a [b, s, h, d] caller's
    acc_lse = torch.randn(2, 3, 9, generator=g) * 4
    blk = torch.randn(2, 3, 9, d, generator=g).to(dtype)
    blk_lse = torch.randn(2, 3, 9, generator=g) * 4
    acc_lse[0, 0, :3] = NEG
    acc[0, 0, :3] = 0
    blk_lse[0, 0, 2:5] = NEG  # row 2: -inf on both sides
    blk_lse[1, 2, 8] = 80.0  # far apart: the accumulator's weight underflows to 0
    return acc, acc_lse, blk, blk_lse


def _within_bound(got, got_lse, ref, ref_lse, acc, blk) -> bool:
    inf = torch.isinf(ref_lse)
    if not torch.equal(inf, torch.isinf(got_lse)) or not torch.equal(got[inf], ref[inf]):
        return False
    m = torch.where(inf, torch.zeros_like(ref_lse), ref_lse)
    out_ok = (got - ref).abs() <= 8 * U32 * (acc.abs() + blk.float().abs())
    lse_ok = (got_lse - ref_lse).nan_to_num(0.0).abs() <= 8 * U32 * (m.abs() + 1)
    return bool(out_ok.all() and lse_ok.all())


def test_registered_op_on_cpu_is_the_torch_expression():
    for fresh in (False, True):
        acc, acc_lse, blk, blk_lse = _inputs()
        a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
        merge_reference(a1, l1, blk, blk_lse, fresh)
        torch.ops.megatron_ring.merge_(a2, l2, blk, blk_lse, fresh, False)
        assert torch.equal(a1, a2) and torch.equal(l1, l2)
    assert torch.equal(a1, blk.float()) and torch.equal(l1, blk_lse)  # fresh: copied in


def test_the_status_copy_rides_on_the_merge():
    """``merge_into(..., status=(dst, src))``: the merge as without it, and ``dst`` takes ``src`` (CPU, and the
    registered op, ``merge_status_``)."""
    for run in (lambda *a, st: merge_into(*a, status=st),
                lambda *a, st: torch.ops.megatron_ring.merge_status_(*a, False, False, *st)):
        acc, acc_lse, blk, blk_lse = _inputs()
        a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
        codes, elem = torch.zeros(3, dtype=torch.bfloat16), torch.full((1,), 1.0, dtype=torch.bfloat16)
        merge_reference(a1, l1, blk, blk_lse)
        run(a2, l2, blk, blk_lse, st=(codes[1:2], elem))
        assert torch.equal(a1, a2) and torch.equal(l1, l2) and codes.tolist() == [0, 1, 0]


def test_a_kernel_lse_of_plus_inf_merges_as_minus_inf():
    """``posinf_empty``: a variable-length kernel's +inf (a row that sees no key) reads as our -inf: the merge,
    fresh or not, equals the merge of the fixed-up lse, bit for bit (CPU and the registered op); NaN stays NaN.
    Negative control: without the flag the +inf rows come out wrong."""
    for fresh in (False, True):
        acc, acc_lse, blk, blk_lse = _inputs()
        blk_lse[1, 1, 3] = float("nan")
        raw = blk_lse.masked_fill(torch.isneginf(blk_lse), float("inf"))
        a1, l1, a2, l2, a3, l3 = (t.clone() for t in (acc, acc_lse) * 3)
        merge_reference(a1, l1, blk, blk_lse, fresh)
        merge_into(a2, l2, blk, raw, fresh, posinf_empty=True)
        torch.ops.megatron_ring.merge_(a3, l3, blk, raw, fresh, True)
        for a, l_ in ((a2, l2), (a3, l3)):
            assert torch.equal(a.nan_to_num(7.0), a1.nan_to_num(7.0)) and torch.equal(l_.nan_to_num(7.0),
                                                                                      l1.nan_to_num(7.0))
        a4, l4 = acc.clone(), acc_lse.clone()
        merge_into(a4, l4, blk, raw, fresh)
        assert not torch.equal(l4.nan_to_num(7.0), l1.nan_to_num(7.0))


def test_merge_into_on_cpu_runs_the_expression_on_row_slices():
    acc, acc_lse, blk, blk_lse = _inputs()
    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
    merge_into(a1[:, :, 2:7], l1[:, :, 2:7], blk[:, :, 2:7], blk_lse[:, :, 2:7])
    merge_reference(a2[:, :, 2:7], l2[:, :, 2:7], blk[:, :, 2:7].clone(), blk_lse[:, :, 2:7].clone())
    assert torch.equal(a1, a2) and torch.equal(l1, l2)
    assert torch.equal(a1[:, :, :2], acc[:, :, :2])  # the rows outside the slice are untouched


def test_the_op_traces_as_one_op_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.seen_ops import SeenOps as Seen

    with FakeTensorMode():
        acc, lse = torch.empty(1, 2, 4, 8), torch.empty(1, 2, 4)
        blk, blk_lse = torch.empty(1, 2, 4, 8, dtype=torch.bfloat16), torch.empty(1, 2, 4)
        with Seen() as seen:
            torch.ops.megatron_ring.merge_(acc, lse, blk, blk_lse, False, False)
    assert seen.ops == ["megatron_ring.merge_.default"]


def check_triton_against_reference() -> None:
    """Run in Triton's interpreter (see the module doc); raises AssertionError on a mismatch."""
    from megatron_ring.core.merge_triton import merge_triton

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for d in (12, 64):
            for fresh in (False, True):
                for rows in (slice(0, 9), slice(2, 7)):
                    acc, acc_lse, blk, blk_lse = _inputs(dtype, d)
                    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
                    a1, l1 = a1.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), l1  # same strides
                    args = (blk[:, :, rows], blk_lse[:, :, rows])
                    merge_reference(a1[:, :, rows], l1[:, :, rows], *args, fresh)
                    merge_triton(a2[:, :, rows], l2[:, :, rows], *args, fresh)
                    assert _within_bound(a2, l2, a1, l1, acc, torch.zeros_like(acc).to(dtype).copy_(blk)), \
                        (dtype, d, fresh, rows, (a2 - a1).abs().max())
                    if fresh:
                        assert torch.equal(a2, a1) and torch.equal(l2, l1)
    # the status copy rides along (the first program copies one element; the merge is unchanged)
    acc, acc_lse, blk, blk_lse = _inputs()
    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
    codes, elem = torch.zeros(4, dtype=torch.bfloat16), torch.full((1,), 2.0, dtype=torch.bfloat16)
    merge_reference(a1, l1, blk, blk_lse)
    merge_triton(a2, l2, blk, blk_lse, False, (codes[2:3], elem))
    assert codes.tolist() == [0, 0, 2, 0] and _within_bound(a2, l2, a1, l1, acc, blk)
    # a kernel's +inf lse (a row that sees no key) reads as -inf
    acc, acc_lse, blk, blk_lse = _inputs()
    raw = blk_lse.masked_fill(torch.isneginf(blk_lse), float("inf"))
    for fresh in (False, True):
        a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
        merge_reference(a1, l1, blk, blk_lse, fresh)
        merge_triton(a2, l2, blk, raw, fresh, None, True)
        assert _within_bound(a2, l2, a1, l1, acc, blk), fresh
    # negative control: a merge of a slightly different block is outside the bound
    acc, acc_lse, blk, blk_lse = _inputs()
    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
    merge_reference(a1, l1, blk, blk_lse)
    merge_triton(a2, l2, blk, blk_lse + 1e-3, False)
    assert not _within_bound(a2, l2, a1, l1, acc, blk)


def test_fused_adds_keep_each_accumulators_order_and_split_only_on_overlap(monkeypatch):
    """The backward's CUDA adds (core/accumulators.py ``add_all``): one ``foreach_into`` where no two blocks of one
    accumulator overlap, a new one where they do (its pairs are updated in parallel); the result equals the
    adds one by one, bit for bit."""
    from megatron_ring.core import accumulators

    calls = []
    real = accumulators.foreach_into
    monkeypatch.setattr(accumulators, "foreach_into", lambda a, b, add: (calls.append((len(a), add)), real(a, b, add)))
    g = torch.Generator().manual_seed(1)
    dq, dk = torch.randn(1, 2, 8, 4, generator=g), torch.randn(1, 2, 8, 4, generator=g)
    blocks = [torch.randn(1, 2, 4, 4, generator=g) * 1e3 for _ in range(4)]
    plan = [("dq", slice(0, 4)), ("dq", slice(4, 8)), ("dk", slice(0, 4)), ("dq", slice(2, 6))]  # last overlaps
    want_q, want_k = dq.clone(), dk.clone()
    for (name, sl), blk in zip(plan, blocks):
        (want_q if name == "dq" else want_k)[:, :, sl].add_(blk)
    accumulators.add_all([(name, sl, (dq if name == "dq" else dk)[:, :, sl], blk) for (name, sl), blk in zip(plan, blocks)])
    assert calls == [(3, [True] * 3), (1, [True])]
    assert torch.equal(dq, want_q) and torch.equal(dk, want_k)
    calls.clear()
    accumulators.add_all([(name, sl, (dq if name == "dq" else dk)[:, :, sl], blk)
                     for (name, sl), blk in zip(plan[:3], blocks)])
    assert calls == [(3, [True] * 3)]  # no overlap: one call
    # a copy (a backward ring's status receipt) joins a call with room for it: no call (no launch) of its own
    calls.clear()
    dst, src = torch.zeros(1), torch.full((1,), 7.0)
    accumulators.add_all([(name, sl, (dq if name == "dq" else dk)[:, :, sl], blk)
                          for (name, sl), blk in zip(plan[:3], blocks)], copies=[(dst, src)])
    assert calls == [(4, [True] * 3 + [False])] and dst.item() == 7.0
    calls.clear()
    four = [("dq", slice(0, 4)), ("dq", slice(4, 8)), ("dk", slice(0, 4)), ("dk", slice(4, 8))]  # no overlap
    accumulators.add_all([(name, sl, (dq if name == "dq" else dk)[:, :, sl], blk)
                          for (name, sl), blk in zip(four, blocks)], add=False, copies=[(dst, src)])
    assert calls == [(4, [False] * 4), (1, [False])]  # the first call full: the copy in one of its own


def test_the_direct_launch_is_taken_only_where_nothing_would_see_the_op():
    """``merge_into`` launches the Triton kernel directly (no dispatcher round trip) only on plain tensors with
    no dispatch mode, torch-function mode or compiler trace; anything that records or fakes ops (the fake-CUDA
    tier's FakeTensorMode and dispatch-mode counters, torch.compile) sees the one registered op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_ring.core.launch import direct_launch_ok

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2)
    assert direct_launch_ok(x, x)
    with Seen():
        assert not direct_launch_ok(x, x)
    with TorchFunctionMode():
        assert not direct_launch_ok(x, x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not direct_launch_ok(fake, x)
    assert not direct_launch_ok(torch.nn.Parameter(x), x)
