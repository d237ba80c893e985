"""GPU check of the variable-length flash kernel of masked tasks (kernels/varlen.py): forward (out, lse) and
backward (dq, dk, dv) of one masked task vs float64 with the same mask, the derived bound. The ``cpu``
variant runs the CPU stand-in (same plans) and runs everywhere; the ``cuda`` variant runs torch's
``aten._flash_attention_forward/_backward`` and needs a GPU (sm80+, bf16; first run on an H200 on 2026-11-27,
where it found the dropped window bound below). Negative controls: the plan with one alignment off by one, and
the kernel given ``max_seqlen_k`` = the longest key segment, fail the bound."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ring.kernels import varlen, varlen_plan
from megatron_ring.schedules.masks import AttentionMask, BlockMask
from tests.helpers.numerics import Checks, lse_tol, max_err, score_bound, tol

# (causal, documents, window, first query position): keys at positions 0..S-1, queries from q_from on
MASKS = [(True, (0, 5, 100, 129, 256), None, 0), (False, (0, 7, 70, 250), None, 0), (True, None, (40, 0), 0),
         (False, (0, 30, 200, 256), (17, 5), 0), (True, (0, 90, 200, 400), None, 64)]
S = 256


def _mask(causal, cu, window, q_from):
    rule = AttentionMask(causal, cu, window)
    kpos, qpos = torch.arange(S), torch.arange(q_from, q_from + S)
    return BlockMask(rule, qpos, rule.doc_ids(qpos), kpos, rule.doc_ids(kpos))


def _reference(q, k, v, dout, ok, scale):
    """float64 masked attention of one block: out, lse (-inf where a row sees no key) and the gradients."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    s = (leaves[0] @ leaves[1].repeat_interleave(g, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    out = p @ leaves[2].repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _off_by_one(plan):
    c = plan.calls[0]
    left, right = c.window
    shifted = dataclasses.replace(c, causal=False, window=(left, right + 1) if right >= 0 else (left + 1, right))
    return varlen_plan.SegmentPlan((shifted,) + plan.calls[1:], plan.shared_keys)


class _RawMaxK(varlen_plan.VarlenCall):
    """A call that hands the kernel its longest key segment as ``max_seqlen_k`` (the mistake the H200 run
    showed: the kernel then drops a right window bound ``>= max_seqlen_k``)."""

    @property
    def kernel_max_k(self) -> int:
        return self.max_k


def _raw_max_k(plan):
    calls = tuple(_RawMaxK(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}) for c in plan.calls)
    return varlen_plan.SegmentPlan(calls, plan.shared_keys)


def varlen_checks(device, mask_args, corrupt=None):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mask = _mask(*mask_args)
    plan = varlen_plan.plan_for(mask)
    assert plan is not None
    if corrupt:
        varlen_plan._PLANS[mask] = {"off_by_one": _off_by_one, "raw_max_k": _raw_max_k}[corrupt](plan)
    kern = varlen._VARLEN_CUDA[None] if device == "cuda" else varlen._VARLEN_CPU
    g = torch.Generator().manual_seed(len(plan.calls))
    q, dout = (torch.randn(2, 4, S, 64, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, S, 64, generator=g).to(device, dtype) for _ in range(2))
    scale = 64 ** -0.5
    ok = mask.allowed().to(device)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, ok, scale)
    varlen.COUNTS.clear()
    out, lse = kern.forward(q, k, v, False, scale, mask=mask)
    grads = kern.backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), False, scale, mask=mask)
    assert varlen.COUNTS == {kern.name: 2}, varlen.COUNTS  # the kernel ran, no fallback
    bound = dict(dtype=dtype, n=S, sigma=score_bound(q.transpose(1, 2), k.transpose(1, 2)))
    checks = Checks(f"varlen {device} {mask_args}")
    checks.add("out", max_err(out, ref_out), tol(ref_out.abs().max().item(), **bound))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)  # rows that see no key: lse -inf (our convention)
    checks.add("lse", max_err(lse[finite], ref_lse[finite]), lse_tol(ref_lse[finite], **bound))
    for what, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        checks.add(what, max_err(got, ref), tol(ref.abs().max().item(), **bound))
    return checks


@pytest.mark.parametrize("mask_args", MASKS, ids=lambda m: f"causal={m[0]}-docs={m[1]}-window={m[2]}-q_from={m[3]}")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_varlen_kernel_vs_float64(device, mask_args):
    varlen_checks(device, mask_args).check()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_varlen_check_catches_an_off_by_one(device):
    try:
        with pytest.raises(AssertionError):
            varlen_checks(device, MASKS[0], corrupt="off_by_one").check()
    finally:
        varlen_plan._PLANS.clear()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_varlen_check_catches_a_window_the_kernel_drops(device):
    """The H200 failure, reproduced by the stand-in: a right bound ``>= max_seqlen_k`` is dropped by the kernel,
    so a call of 120 query rows over 56 keys with the window ``(-1, 64)`` given ``max_seqlen_k = 56`` attends
    every key (out off by 2.9, dq by 83 on the GPU)."""
    try:
        with pytest.raises(AssertionError):
            varlen_checks(device, MASKS[4], corrupt="raw_max_k").check()
    finally:
        varlen_plan._PLANS.clear()
