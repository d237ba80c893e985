"""A ring call under ``torch.autocast`` behaves as torch's ``scaled_dot_product_attention`` does there
(megatron_ring/core/autocast.py): q, k and v go to the autocast dtype (fp32 q and k from an fp32 rotary embedding
beside a bf16 v included), the output has that dtype, and the call, forward and backward, computes as the same call
on the cast inputs without autocast. The backward is taken INSIDE the autocast region (on CPU it then runs with
autocast on, on the calling thread).

P ranks run as threads (``tests.helpers.ring_fakes.run_threads``). Checked per rank: the output and every gradient
are bit-identical to the call on inputs cast by hand (fp32 leaves' gradients are the bf16 ones widened), for the
kernels autocast would reach (``math``, dropout's matmul kernel, the max-logit pass) and the fused CPU kernel; and
the output and gradients against the float64 reference of the cast inputs within the derived bound. Negative
controls: the call with autocast left on inside (its fp32 accumulation then runs in bf16) is not the cast call, and
without the entry cast the output keeps fp32. On the CUDA path (fake tier): fp32 inputs under autocast run a
bf16 kernel, not ``math``."""
from __future__ import annotations

import contextlib

import pytest
import torch

import megatron_ring.api as api
import megatron_ring.core.autograd as autograd_mod
from megatron_ring import ring_attention
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.numerics import grad_terms, max_err, score_bound, tol
from tests.helpers.reference import attention_reference
from tests.helpers.ring_fakes import run_threads

P, S, H, HKV, D = 3, 24, 4, 2, 16
BF16 = torch.bfloat16


def _inputs(dtypes=(torch.float32, torch.float32, BF16)):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, n, D, generator=g).to(dt) for n, dt in zip((H, HKV, HKV), dtypes))
    dout = torch.randn(1, S, H, D, generator=g).to(BF16)
    return q, k, v, dout


def _run(q, k, v, dout, autocast: bool, kw: dict):
    """Per rank: (out, max_logit or None, dq, dk, dv) of a causal zigzag call; backward inside the region."""
    pos = [get_layout("zigzag").positions(S, P, r) for r in range(P)]

    def body(rank, ring):
        leaves = [t[:, pos[rank]].clone().requires_grad_() for t in (q, k, v)]
        region = torch.autocast("cpu", dtype=BF16) if autocast else contextlib.nullcontext()
        with region:
            got = ring_attention(*leaves, ring=ring, causal=True, **kw)
            out, ml = got if isinstance(got, tuple) else (got, None)
            out.backward(dout[:, pos[rank]])
        return out.detach(), ml, *(t.grad for t in leaves)

    results = run_threads(body, P)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


CASES = {
    "math": dict(kernel="math"),
    "flash_cpu": dict(kernel="flash_cpu"),
    "dropout": dict(dropout_p=0.2, dropout_seed=5),
    "max_logit": dict(kernel="math", return_max_logit=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_autocast_call_is_the_call_on_cast_inputs(name):
    q, k, v, dout = _inputs()
    got = _run(q, k, v, dout, True, CASES[name])
    want = _run(q.to(BF16), k.to(BF16), v, dout, False, CASES[name])
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g[0].dtype == BF16, (rank, g[0].dtype)  # as SDPA's output under autocast
        assert torch.equal(g[0], w[0]), (name, rank, "out")
        if w[1] is not None:
            assert torch.equal(g[1], w[1]), (name, rank, "max_logit")
        for what, a, b, leaf in zip(("dq", "dk", "dv"), g[2:], w[2:], (q, k, v)):
            assert a.dtype == leaf.dtype, (rank, what, a.dtype)  # fp32 leaves get fp32 gradients
            assert torch.equal(a, b.to(a.dtype)), (name, rank, what)


def test_autocast_call_against_float64():
    """Independent reference: the float64 attention of the bf16-rounded inputs, outputs and gradients."""
    q, k, v, dout = _inputs()
    got = _run(q, k, v, dout, True, dict(kernel="math"))
    qr, kr, vr = (t.to(BF16).double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(qr, kr, vr, causal=True)
    ref.backward(dout.double())
    sigma, n = score_bound(qr, kr), S
    bounds = dict(dtype=BF16, n=n, sigma=sigma, blocks=2 * P)
    gmax = grad_terms(qr, kr, vr, dout, n=S)
    for rank in range(P):
        pos = get_layout("zigzag").positions(S, P, rank)
        out, _, dq, dk, dv = got[rank]
        assert max_err(out, ref.detach()[:, pos]) <= tol(ref.detach().abs().max().item(), **bounds), rank
        for name, a, r in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
            m = max(r.abs().max().item(), gmax if name != "dv" else 0.0)
            # dK/dV of a rank sum over every rank's queries: its slice of the full gradient is this rank's positions
            assert max_err(a, r[:, pos]) <= tol(m, **bounds), (rank, name)


def test_negative_control_autocast_left_on_inside_changes_the_result(monkeypatch):
    """The call with the cast but autocast left on inside (forward and backward): ``math``'s fp32 einsums run in bf16,
    so the result is not the cast call's: the test above would fail."""
    null = lambda device_type: contextlib.nullcontext()  # noqa: E731
    monkeypatch.setattr(api, "autocast_off", null)
    monkeypatch.setattr(autograd_mod, "autocast_off", null)
    q, k, v, dout = _inputs()
    got = _run(q, k, v, dout, True, CASES["math"])
    want = _run(q.to(BF16), k.to(BF16), v, dout, False, CASES["math"])
    assert any(not torch.equal(a, b.to(a.dtype)) for g, w in zip(got, want) for a, b in zip(g[2:], w[2:]))
    assert any(not torch.equal(g[0], w[0]) for g, w in zip(got, want))


def test_negative_control_without_the_cast_the_output_keeps_fp32(monkeypatch):
    monkeypatch.setattr(api, "autocast_inputs", lambda device_type, *t: None)
    q, k, v, dout = _inputs((torch.float32,) * 3)
    got = _run(q, k, v, dout.float(), True, CASES["flash_cpu"])
    assert all(g[0].dtype == torch.float32 for g in got)


def test_mixed_dtypes_without_autocast_are_refused_by_name():
    """Outside autocast nothing is cast: q, k and v of different dtypes are refused, as SDPA refuses them."""
    q, k, v, dout = _inputs()
    with pytest.raises(ValueError, match="dtype"):
        _run(q, k, v, dout, False, {})


def test_float64_inputs_are_not_cast():
    """float64 is outside autocast's lower-precision policy (as for SDPA): the call stays float64."""
    q, k, v, dout = _inputs((torch.float64,) * 3)
    got = _run(q, k, v, dout.double(), True, CASES["math"])
    want = _run(q, k, v, dout.double(), False, CASES["math"])
    for g, w in zip(got, want):
        assert g[0].dtype == torch.float64
        assert all(torch.equal(a, b) for a, b in zip(g[2:], w[2:]))
