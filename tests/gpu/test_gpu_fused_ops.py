"""The Triton list op (core/foreach_triton.py) and the merge's status rider (core/merge_triton.py) on a GPU,
against torch's own ops: bit-equal (on a GPU the fp32 -> bf16 cast rounds to nearest even, as torch's does;
Triton's interpreter on CPU truncates, so tests/test_foreach_fused.py holds bf16 copies to one ulp there)."""
from __future__ import annotations

import torch

from megatron_ring.core.foreach_triton import ADD, COPY, ZERO, foreach_triton
from megatron_ring.core.merge import merge_reference
from megatron_ring.core.merge_triton import merge_triton
from tests.test_foreach_fused import _pairs


def test_foreach_kernel_is_bit_equal_to_torch():
    accs, srcs = (_to(t) for t in _pairs())
    want = [a.clone() for a in accs]
    for w, s in zip(want, srcs):
        w.add_(s)
    got = [a.clone() for a in accs]
    foreach_triton(got, srcs, [ADD] * 4)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    dsts = [torch.empty_like(s) for s in srcs]
    foreach_triton(dsts, want, [COPY] * 4)
    assert all(torch.equal(d, w.to(d.dtype)) for d, w in zip(dsts, want))
    mixed = [a.clone() for a in accs[:3]]
    foreach_triton(mixed, [srcs[0], None, srcs[2]], [ADD, ZERO, COPY])
    assert torch.equal(mixed[0], want[0]) and not mixed[1].any() and torch.equal(mixed[2], srcs[2].float())
    bad = [a.clone() for a in accs]  # negative control
    foreach_triton(bad, [s * 1.001 for s in srcs], [ADD] * 4)
    assert not all(torch.equal(w, b) for w, b in zip(want, bad))


def test_merge_kernel_records_the_status_and_merges_as_without_it():
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(2, 3, 9, 64, generator=g).cuda()
    lse = (torch.randn(2, 3, 9, generator=g) * 4).cuda()
    blk = torch.randn(2, 3, 9, 64, generator=g).cuda().bfloat16()
    blk_lse = (torch.randn(2, 3, 9, generator=g) * 4).cuda()
    a1, l1, a2, l2 = acc.clone(), lse.clone(), acc.clone(), lse.clone()
    codes = torch.zeros(4, dtype=torch.bfloat16, device="cuda")
    elem = torch.full((1,), 2.0, dtype=torch.bfloat16, device="cuda")
    merge_triton(a1, l1, blk, blk_lse, False)
    merge_triton(a2, l2, blk, blk_lse, False, (codes[3:4], elem))
    assert torch.equal(a1, a2) and torch.equal(l1, l2) and codes.tolist() == [0, 0, 0, 2]
    a3, l3 = acc.clone(), lse.clone()
    merge_reference(a3, l3, blk, blk_lse)
    assert torch.allclose(a1, a3, rtol=1e-5, atol=1e-6) and torch.allclose(l1, l3, rtol=1e-6, atol=1e-6)


def _to(tensors):
    """The tensors on the GPU (``.cuda()`` keeps a permuted tensor's strides; a row slice is sliced again there)."""
    out = [t.cuda() for t in tensors]
    if out[1].dtype == torch.float32:  # the accumulators: the row slice of _pairs, as a slice on the GPU too
        whole = torch.zeros(1, 3, 1100, 5, device="cuda")
        whole[:, :, 7:1050] = out[1]
        out[1] = whole[:, :, 7:1050]
    return out


def test_launches_of_a_kept_compiled_kernel_equal_tritons_own(monkeypatch):
    """megatron_ring/triton_launch.py on a GPU: the list op and the merge launched again with the same key call the
    kept compiled kernel (Triton's ``kernel[grid]`` is not called again) and give the bytes Triton's own launch
    gives, over new data, aligned and misaligned addresses alike."""
    from megatron_ring.core import foreach_triton as F
    from megatron_ring.core import merge_triton as M

    calls = []

    class Counting:  # the jitted kernel, its launches through Triton counted
        def __init__(self, fn):
            self.fn, self.arg_names = fn, fn.arg_names

        def __getitem__(self, grid):
            calls.append(grid)
            return self.fn[grid]

    merge, lists = M._kernel(), F._kernel()
    counted = Counting(merge), Counting(lists)  # made once, as the lru-cached getters give one kernel object
    monkeypatch.setattr(M, "_kernel", lambda: counted[0])
    monkeypatch.setattr(F, "_kernel", lambda: counted[1])
    g = torch.Generator(device="cuda").manual_seed(3)
    for offset in (0, 1):  # an address 16-byte aligned, then one that is not: two keys
        for rnd in range(3):
            acc = torch.randn(2 * 3 * 9 * 64 + offset, device="cuda", generator=g)[offset:].view(2, 3, 9, 64)
            lse = torch.randn(2, 3, 9, device="cuda", generator=g) * 4
            blk = torch.randn(2, 3, 9, 64, device="cuda", generator=g).bfloat16()
            blk_lse = torch.randn(2, 3, 9, device="cuda", generator=g) * 4
            a1, l1, a2, l2 = acc.clone(), lse.clone(), acc.clone(), lse.clone()
            M.merge_triton(a1, l1, blk, blk_lse, False)  # through the launcher
            merge[(2 * 3 * 9,)](a2, l2, blk, blk_lse, 3, 9, 64, *a2.stride(), *l2.stride(), *blk.stride(),
                                *blk_lse.stride(), l2, l2, FRESH=False, STATUS=False, POSINF=False, BLOCK_D=64)
            assert torch.equal(a1, a2) and torch.equal(l1, l2)
            dst = torch.empty(acc.numel() + offset, device="cuda")[offset:].view(acc.shape).copy_(acc)
            src = torch.randn(2, 3, 9, 64, device="cuda", generator=g).bfloat16()
            want = acc.clone().add_(src)
            F.foreach_triton([dst], [src], [F.ADD])
            assert torch.equal(dst, want)
    # each kernel went through Triton once per key (aligned, misaligned), the other launches through the kept kernel
    assert len(calls) == 4, calls
