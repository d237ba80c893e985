"""The list op (``torch.ops.megatron_ring.foreach_``, core/foreach.py) against torch's ops pair by pair.

CPU: the registered op is ``dst.add_(src)`` / ``dst.copy_(src)`` pair by pair (bit-equal) and traces under
FakeTensorMode as one op. :func:`check_triton_against_torch` (run by tests/fake_cuda/test_triton_kernels.py, where
Triton is installed): the CUDA kernel of core/foreach_triton.py runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``; the kernel module is re-imported under it) on pairs of 1 to 4
dims, adds, copies, zeroings and -inf-to-+inf copies mixed in one launch, a last dim wider than a program's
columns, strided and row-slice views, fp32 accumulators with bf16/fp16/fp32 sources, more pairs than one launch
takes, and sizes that are not a multiple of its block. The bound: an add into fp32 is ONE fp32 rounding of the
same two operands on both sides (torch computes ``dst + float(src)`` in fp32): bit-equal. A copy to a narrower
type: bit-equal on a GPU, where the cast rounds to nearest even as torch's does; Triton's interpreter truncates
fp32 -> bf16 instead (its numpy emulation), so there a bf16 copy is held to one bf16 unit in the last place,
``2**-7 |x|``, and an fp16 copy (numpy rounds to nearest even) is bit-equal. A negative control shows the
comparison fails on a wrong add.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring.core.foreach import foreach_into, foreach_reference
from megatron_ring.core.foreach_triton import ADD, COPY, FLIP, ZERO


def _pairs(seed: int = 0):
    """(fp32 accumulators, sources): a BSHD-ordered 4-d view, a row slice, a 3-d and a 1-d tensor, in
    bf16 / fp16 / fp32 / bf16; sizes that no block divides."""
    g = torch.Generator().manual_seed(seed)
    accs = [torch.randn(2, 9, 3, 12, generator=g).permute(0, 2, 1, 3),
            torch.randn(1, 3, 1100, 5, generator=g)[:, :, 7:1050],
            torch.randn(3, 70, 6, generator=g),
            torch.randn(7, generator=g)]
    srcs = [torch.randn(2, 3, 9, 12, generator=g).bfloat16(),
            torch.randn(1, 3, 1043, 5, generator=g).half(),
            torch.randn(3, 6, 70, generator=g).transpose(1, 2),
            torch.randn(7, generator=g).bfloat16()]
    return accs, srcs


def test_the_flip_mode_is_the_kernels_lse_convention():
    """FLIP: a copy with -inf made +inf (a variable-length kernel's lse), NaN and +inf kept, bit for bit as the
    kernel's own fix-up (``nan_to_num``, kernels/varlen.py)."""
    lse = torch.tensor([0.5, float("-inf"), float("inf"), float("nan"), -3.0])
    got = torch.empty_like(lse)
    foreach_into([got], [lse], flip=True)
    want = lse.nan_to_num(nan=float("nan"), neginf=float("inf"), posinf=float("inf"))
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and got[3].isnan()


def test_registered_op_on_cpu_is_torch_pair_by_pair():
    for modes in ([ADD] * 4, [COPY] * 4, [ADD, ZERO, COPY, ZERO]):
        accs, srcs = _pairs()
        srcs = [None if m == ZERO else x for x, m in zip(srcs, modes)]
        want = [a.clone() for a in accs]
        foreach_reference(want, srcs, modes)
        got = [a.clone() for a in accs]
        torch.ops.megatron_ring.foreach_(got, srcs, modes)
        assert all(torch.equal(w, x) for w, x in zip(want, got))
        for a, x, m, w in zip(accs, srcs, modes, want):
            assert torch.equal(w, a + x.float() if m == ADD else x.float() if m == COPY else torch.zeros_like(a))


def test_the_op_traces_as_one_op_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.seen_ops import SeenOps as Seen

    with FakeTensorMode():
        accs = [torch.empty(2, 4), torch.empty(3)]
        srcs = [torch.empty(2, 4, dtype=torch.bfloat16), torch.empty(3, dtype=torch.bfloat16)]
        with Seen() as seen:
            torch.ops.megatron_ring.foreach_(accs, srcs, [ADD, ADD])
    assert seen.ops == ["megatron_ring.foreach_.default"]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal, or for bf16 within one unit in the last place (the interpreter's truncating cast)."""
    if got.dtype != torch.bfloat16:
        return torch.equal(got, want)
    return bool(((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs()).all())


def check_triton_against_torch() -> None:
    """Run in Triton's interpreter (see the module doc); raises AssertionError on a mismatch."""
    from megatron_ring.core.foreach_triton import ENTRIES, foreach_triton

    accs, srcs = _pairs()
    want = [a.clone() for a in accs]
    foreach_reference(want, srcs, [ADD] * 4)
    got = [a.clone() for a in accs]
    foreach_triton(got, srcs, [ADD] * 4)
    assert all(torch.equal(w, x) for w, x in zip(want, got)), [(w - x).abs().max() for w, x in zip(want, got)]
    # copies to the sources' dtypes and strides (the results' conversion), more pairs than one launch takes
    dsts = [torch.empty_like(s) for s in srcs] + [torch.empty(3, 5).t()]
    fp32 = want + [torch.randn(5, 3)]
    assert len(dsts) > ENTRIES
    foreach_triton(dsts, fp32, [COPY] * len(dsts))
    for d, w in zip(dsts, fp32):
        assert _close(d, w.to(d.dtype)), (d.dtype, (d.float() - w).abs().max())
    # a last dim wider than a program's columns (run in chunks) beside a narrow one, rows not a tile's multiple
    wide = [torch.randn(3, 7, 300, generator=torch.Generator().manual_seed(5)), torch.randn(1, 3)]
    into = [torch.zeros(3, 300, 7).transpose(1, 2), torch.zeros(1, 3)]
    foreach_triton(into, wide, [COPY, COPY])
    assert all(torch.equal(d, w) for d, w in zip(into, wide))
    # modes mixed in one launch: an add, a zeroing (its src not read), a copy, a copy with -inf made +inf
    lse = torch.tensor([[0.5, float("-inf"), float("inf"), float("nan"), -3.0]])
    mixed = [a.clone() for a in accs[:3]] + [torch.empty_like(lse)]
    foreach_triton(mixed, [srcs[0], None, srcs[2], lse], [ADD, ZERO, COPY, FLIP])
    assert torch.equal(mixed[0], want[0]) and not mixed[1].any() and torch.equal(mixed[2], srcs[2])
    assert mixed[3][0, :3].tolist() == [0.5, float("inf"), float("inf")] and mixed[3][0, 3].isnan()
    assert mixed[3][0, 4] == -3.0
    # a step's adds with a backward ring's status receipt (core/backward_check.py: BackwardTag): every value a status
    # element of the FP8 wire (uint8) or of a bf16 wire holds is copied exactly
    from megatron_ring.core.backward_check import backward_values
    from megatron_ring.core.status import tag_value
    for dtype in (torch.uint8, torch.bfloat16):
        values = [tag_value(t, dtype) for t in (1, 2, 252, 253, 123456789)]
        values += list(backward_values(987654321, dtype)[:8])
        for value in values + [0, 1, 2]:
            src, dst = torch.full((1,), value, dtype=dtype), torch.zeros(1, dtype=dtype)
            adds = [a.clone() for a in accs[:3]]
            foreach_triton(adds + [dst], srcs[:3] + [src], [ADD] * 3 + [COPY])
            assert torch.equal(dst, src) and all(torch.equal(x, w) for x, w in zip(adds, want[:3])), (dtype, value)
    # shapes it does not take are refused by name, before any launch
    with pytest.raises(ValueError, match="at most 4 dims"):
        foreach_triton([torch.empty(1, 1, 1, 1, 2)], [torch.empty(1, 1, 1, 1, 2)], [COPY])
    with pytest.raises(ValueError, match="equal shapes"):
        foreach_triton([torch.empty(2, 3)], [torch.empty(3, 2)], [COPY])
    # negative control: a wrong add is caught
    bad = [a.clone() for a in accs]
    foreach_triton(bad, [s * 1.001 for s in srcs], [ADD] * 4)
    assert not all(torch.equal(w, x) for w, x in zip(want, bad))


def test_foreach_into_on_cpu_is_the_reference_and_takes_an_empty_list():
    accs, srcs = _pairs(1)
    want = [a.clone() for a in accs]
    foreach_reference(want, [srcs[0], None, srcs[2], srcs[3]], [ADD, ZERO, COPY, ADD])
    foreach_into(accs, [srcs[0], None, srcs[2], srcs[3]], add=[True, False, False, True])
    assert all(torch.equal(w, x) for w, x in zip(want, accs))
    foreach_into([], [])
