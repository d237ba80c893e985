"""Head dims a kernel does not take run on it zero-padded (kernels/head_dim.py), exactly.

The fused CUDA kernels (cuDNN, torch's flash, the variable-length flash kernel, flash_attn, TransformerEngine)
take head dims that are multiples of 8 (``BlockKernel.head_dim_multiple``). A call whose head dim is not one
(100, say) used to run on the math kernel, which materialises every block's scores in fp32. It now runs on
the fused kernel with Q, K and V zero-padded to the next multiple of 8, as torch's SDPA pads them for its flash
kernel, at the call's own softmax scale (``1/sqrt(d)``, not the padded dim's).

On CPU the fused kernels cannot run, so a kernel that takes only multiples of 8 stands in: torch's CPU flash
kernel that asserts the head dim of every operand it is handed. Through the whole ring (P threads, P = 1, 2,
4; every layout, causal and not, GQA, MLA head dims both ways, packed documents with a window on the masked
tasks' variable-length stand-in, bf16), outputs and dq/dk/dv are compared with the float64 reference at the
call's head dim, within the derived bound of tests/helpers/numerics.py. Negative control: the padded head
dim's softmax scale fails that bound. A rank refusing its input on the collective comm types runs its forward on
zeros on the padded kernel too (with MLA head dims it crashed in the CPU flash kernel). The engine pads each
operand once per ring, the visiting K/V blocks into buffers reused every step (counted here, with a negative
control: a buffer never rewritten fails the bound). The choice itself (which kernel ``auto`` picks, what a named kernel
refuses) is checked on fake CUDA in tests/fake_cuda/test_kernel_refusals.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.kernels import varlen
from megatron_ring.kernels.block import FlashCPUKernel, MathKernel, operand_head_dim
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.numerics import max_err, score_bound, tol
from tests.helpers.reference import doc_attention_reference, outputs_and_grads
from tests.helpers.ring_fakes import thd_ring_in_global_order


class MultipleOf8(FlashCPUKernel):
    """torch's CPU flash kernel, taking head dims that are multiples of 8 only, as the fused CUDA kernels do
    (``name`` stays ``flash_cpu``: the masked tasks then run on the variable-length CPU stand-in)."""

    head_dim_multiple = 8

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def _check(self, q, k, v):
        dims = (q.shape[-1], k.shape[-1], v.shape[-1])
        self.seen.append(dims)
        assert all(d % 8 == 0 for d in dims), f"handed head dims {dims}"

    def forward(self, q, k, v, causal, scale, mask=None):
        self._check(q, k, v)
        return super().forward(q, k, v, causal, scale, mask=mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        self._check(q, k, v)
        return super().backward(dout, q, k, v, out, lse, causal, scale, mask=mask)


def _ring(world, layout_name, causal, dims, *, dtype=torch.float32, cu=None, window=None, scale=None, kernel=None):
    """(rows of (what, error, bound), the kernel): the ring over P threads vs the float64 reference (``kernel``:
    :class:`MultipleOf8` unless given)."""
    d, dv = dims
    h, hk, T = 4, 2, 12 * world
    layout = get_layout(layout_name)
    g = torch.Generator().manual_seed(7 + d + 3 * dv)
    q, k = torch.randn(T, h, d, generator=g).to(dtype), torch.randn(T, hk, d, generator=g).to(dtype)
    v, dout = torch.randn(T, hk, dv, generator=g).to(dtype), torch.randn(T, h, dv, generator=g).to(dtype)
    ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, cu or [0, T], causal, window),
                            q.double(), k.double(), v.double(), dout.double())
    kernel = kernel or MultipleOf8()
    got = thd_ring_in_global_order(world, layout, q, k, v, dout, causal=causal, kernel=kernel, window=window,
                                   cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32),
                                   softmax_scale=scale)
    rows = [(what, max_err(a, want), tol(want.abs().max().item(), dtype=dtype, n=max(T, d, dv),
                                         sigma=score_bound(q, k), blocks=2 * world))
            for what, a, want in zip(("out", "dq", "dk", "dv"), got, ref)]
    return rows, kernel


@pytest.fixture
def stand_in_saw(monkeypatch) -> list[tuple[int, int, int]]:
    """The head dims (q, k, v) of each forward call of the variable-length CPU stand-in (masked tasks), its counts
    cleared."""
    stand_in, saw = varlen._VARLEN_CPU, []

    def spy(q, k, v, *a, **kws):
        saw.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return type(stand_in).forward(stand_in, q, k, v, *a, **kws)
    monkeypatch.setattr(stand_in, "forward", spy)
    varlen.COUNTS.clear()
    return saw


CASES = [("zigzag", True, (12, 12), {}), ("striped", False, (20, 20), {}), ("contiguous", True, (12, 10), {}),
         ("zigzag", False, (10, 12), {}), ("zigzag", True, (16, 12), {}),
         ("striped", True, (12, 12), dict(cu=[0, 5, 6, 19, 30, 45], window=(7, 0))),
         ("zigzag", True, (12, 12), dict(dtype=torch.bfloat16))]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout, causal, dims, kw", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_padded_head_dims_match_float64(world, layout, causal, dims, kw, stand_in_saw):
    if kw.get("cu"):  # the documents that fit the stream of 12 * P tokens
        kw = dict(kw, cu=[c for c in kw["cu"] if c <= 12 * world])
    with varlen.cpu_stand_in():
        rows, kernel = _ring(world, layout, causal, dims, **kw)
    bad = [row for row in rows if not row[1] <= row[2]]
    assert not bad, bad
    padded = {(operand_head_dim(kernel, max(dims)),) * 3}
    assert set(kernel.seen) <= padded and set(stand_in_saw) <= padded, (kernel.seen, stand_in_saw)
    if kw.get("cu"):  # documents and a window: the masked tasks ran on the variable-length stand-in
        assert stand_in_saw and varlen.COUNTS["varlen_cpu"] > 0 and varlen.COUNTS["math"] == 0, varlen.COUNTS
    else:
        assert kernel.seen


class TakesHeadDims(MathKernel):
    """A dense kernel that takes MLA head dims as they are, as cuDNN does where torch's own SDPA hands them to it
    (``name`` stays ``math``: the masked tasks run on the variable-length CPU stand-in, which, like the CUDA
    variable-length kernel, gets one head dim: padded)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def forward(self, q, k, v, causal, scale, mask=None):
        self.seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return super().forward(q, k, v, causal, scale, mask=mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        self.seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return super().backward(dout, q, k, v, out, lse, causal, scale, mask=mask)


@pytest.mark.parametrize("world", [2, 4])  # one rank: its one block is cut by the document's end, all masked
@pytest.mark.parametrize("dims", [(12, 10), (10, 12), (16, 8)], ids=str)
def test_mla_head_dims_as_they_are_with_padded_masked_tasks(world, dims, stand_in_saw):
    """A dense kernel that takes MLA head dims as they are (cuDNN, where torch's rule says so) gets them unpadded,
    while the call's masked tasks (cut by a document's end) run on the variable-length stand-in padded to the larger
    head dim (the engine pads their operands once per ring); outputs and gradients match float64."""
    # a short first document: the blocks it cuts are masked tasks, the rest of the stream dense ones
    with varlen.cpu_stand_in():
        rows, kernel = _ring(world, "zigzag", True, dims, cu=[0, 3, 12 * world], kernel=TakesHeadDims())
    assert not [row for row in rows if not row[1] <= row[2]], rows
    dqk, dv = dims
    assert kernel.seen and set(kernel.seen) == {(dqk, dqk, dv)}, kernel.seen
    assert stand_in_saw and set(stand_in_saw) == {(max(dims),) * 3}, stand_in_saw
    assert varlen.COUNTS["math"] == 0, varlen.COUNTS


def test_the_padded_dims_softmax_scale_fails_the_bound():
    """Not vacuous: the scale of the padded head dim (16) instead of the call's (12) fails the bound."""
    rows, _ = _ring(2, "zigzag", True, (12, 12), scale=16 ** -0.5)
    assert any(not err <= bound for _, err, bound in rows), rows


@pytest.mark.parametrize("world", [2, 4])
def test_operands_are_padded_once_per_ring(world, monkeypatch):
    """The engine pads what every step shares once per ring (q in the forward; dO, q and O in the backward) and
    each visiting K/V block into a buffer zeroed once per ring (kernels/head_dim.py: RingPads): the fresh padded
    tensors of one forward + backward do not grow with P (per kernel call before: 3 per forward block, 5 per
    backward block); every kernel call still gets operands of the padded head dim, and the results match float64."""
    from megatron_ring.kernels import head_dim

    made = []
    real = head_dim._pad_last

    def counting(x, d):
        got = real(x, d)
        if got is not x:
            made.append(tuple(x.shape))
        return got
    monkeypatch.setattr(head_dim, "_pad_last", counting)
    rows, kernel = _ring(world, "zigzag", True, (12, 12))
    assert all(err <= bound for _, err, bound in rows), rows
    # P ranks (threads sharing the kernel), each P forward and P backward blocks (zigzag: one task per step)
    assert set(kernel.seen) == {(16, 16, 16)} and len(kernel.seen) == 2 * world * world, kernel.seen
    # per rank: forward q + a K and a V buffer, backward dO, q, O + a K and a V buffer
    assert len(made) == world * (3 + 5), made


def test_a_stale_padded_block_fails_the_bound(monkeypatch):
    """Not vacuous: a K/V buffer that keeps its first block (never rewritten at later steps) fails the bound."""
    from megatron_ring.kernels import head_dim

    def stale(self, x, role):
        key = (role, tuple(x.shape), x.dtype)
        if key not in self._buffers:
            self._buffers[key] = head_dim._pad_last(x, self.d)
        return self._buffers[key]
    monkeypatch.setattr(head_dim.RingPads, "block", stale)
    rows, _ = _ring(4, "zigzag", True, (12, 12))
    assert any(not err <= bound for _, err, bound in rows), rows


def _refusal_worker(rank, world):
    """A rank that refuses its kernel after the cross-rank check, on the collective comm types with MLA head dims:
    its forward on zeros (which the others' collectives wait for) runs on the padded kernel too. Last, the
    negative control: without the padding there, torch's CPU flash kernel rejects the unequal head dims."""
    from megatron_ring import call as call_mod
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 8, 4, 16, generator=g), torch.randn(1, 8, 4, 16, generator=g), torch.randn(1, 8, 4, 8,
                                                                                                      generator=g)
    got = []
    for comm_type, unpadded in (("a2a", False), ("all_gather", False), ("a2a", True)):
        if unpadded:
            call_mod.Call.padded = lambda self, kernel: kernel
        try:
            ring_attention(q, k, v, causal=True, comm_type=comm_type, timeout_s=20,
                           kernel="cudnn" if rank == 1 else "auto")  # cudnn: not on a CPU, refused on rank 1 only
            got.append("returned")
        except Exception as exc:  # noqa: BLE001 - the outcome is the test
            got.append(type(exc).__name__)
    return got


@pytest.mark.slow
def test_a_refusal_on_the_collective_comm_types_runs_the_padded_kernel():
    from tests.helpers.launch import run_distributed

    got = run_distributed(_refusal_worker, 2, timeout=120)
    assert [r[:2] for r in got] == [["RingInputError"] * 2, ["ValueError"] * 2], got
    assert got[1][2] == "RuntimeError", got  # the control: the refusing rank crashed in the CPU flash kernel
