"""The LSE merge and the local block kernels against float64 references."""
import pytest
import torch

from tests.helpers.numerics import lse_tol, max_err, score_bound, tol
from megatron_ring.kernels.block import FlashCPUKernel, MathKernel, select_kernel
from megatron_ring.core.merge import merge_into


def test_merge_equals_softmax_over_union_without_overflow():
    torch.manual_seed(0)
    b, h, n, d, ka, kb = 2, 3, 5, 4, 7, 9
    s = torch.randn(b, h, n, ka + kb, dtype=torch.float64) * 3000.0  # exp() would overflow
    v = torch.randn(b, h, ka + kb, d, dtype=torch.float64)
    full = torch.softmax(s, -1) @ v
    part = lambda sl: (torch.softmax(s[..., sl], -1) @ v[..., sl, :], torch.logsumexp(s[..., sl], -1))  # noqa
    (oa, la), (ob, lb) = part(slice(0, ka)), part(slice(ka, None))
    acc, lse = oa.clone(), la.clone()
    merge_into(acc, lse, ob, lb)
    assert torch.isfinite(acc).all()
    # float64 throughout: the derived bound with float64 accumulation, |scores| <= max |s|
    kw = dict(dtype=torch.float64, acc=torch.float64, n=ka + kb, sigma=s.abs().max().item())
    assert max_err(acc, full) <= tol(full.abs().max().item(), **kw)
    assert max_err(lse, torch.logsumexp(s, -1)) <= lse_tol(torch.logsumexp(s, -1), **kw)


def test_merge_handles_empty_rows():
    acc = torch.zeros(1, 1, 3, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    blk = torch.ones(1, 1, 3, 2)
    blk_lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])
    merge_into(acc, lse, blk, blk_lse)
    assert torch.equal(acc[0, 0, 1], torch.zeros(2)) and lse[0, 0, 1] == float("-inf")
    assert torch.equal(acc[0, 0, 0], torch.ones(2)) and lse[0, 0, 2] == 1.0


def _reference(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


@pytest.mark.parametrize("kernel", [MathKernel(), FlashCPUKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 2), (4, 1)])
def test_kernel_forward_backward(kernel, causal, h, h_kv):
    torch.manual_seed(1)
    b, sq, sk, d, scale = 2, 24, 24 if causal else 40, 80, 0.11
    q = torch.randn(b, h, sq, d).double().requires_grad_()  # fp32 values: the kernels' inputs exactly
    k = torch.randn(b, h_kv, sk, d).double().requires_grad_()
    v = torch.randn(b, h_kv, sk, d).double().requires_grad_()
    ref_out, ref_lse = _reference(q, k, v, causal, scale)
    dout = torch.randn_like(ref_out).float().double()
    ref_out.backward(dout)
    _assert_kernel_matches(kernel, q, k, v, causal, scale, ref_out, ref_lse, dout)


def _assert_kernel_matches(kernel, q, k, v, causal, scale, ref_out, ref_lse, dout):
    """fp32 kernel forward/backward vs the float64 reference (``q.grad`` etc. already computed)."""
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    assert all(torch.equal(a.double(), b) for a, b in zip((q32, k32, v32, dout.float()), (q, k, v, dout))), \
        "the float64 reference must be fed fp32-representable inputs"
    out, lse = kernel.forward(q32, k32, v32, causal, scale)
    kw = dict(dtype=torch.float32, n=max(q.shape[2], k.shape[2], q.shape[3]), sigma=score_bound(q, k, scale))
    assert max_err(out, ref_out) <= tol(ref_out.abs().max().item(), **kw)
    assert max_err(lse, ref_lse) <= lse_tol(ref_lse, **kw)
    grads = kernel.backward(dout.float(), q32, k32, v32, out, lse, causal, scale)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert got.shape == want.shape
        assert max_err(got, want) <= tol(want.abs().max().item(), **kw)


def test_select_kernel():
    q = torch.randn(1, 1, 4, 8)
    assert select_kernel(q).name == "flash_cpu"
    assert select_kernel(q, "math").name == "math"
    with pytest.raises(ValueError, match="unknown kernel"):
        select_kernel(q, "no_such_kernel")
    with pytest.raises(ValueError, match="does not support"):
        select_kernel(q, "flash_cuda")
    with pytest.raises(ValueError, match="not verified on a GPU"):
        select_kernel(q, "sdpa_cuda")


@pytest.mark.parametrize("inner", [MathKernel(), FlashCPUKernel()], ids=lambda k: k.name)
def test_reversed_kernel_is_the_upper_triangle(inner):
    """ReversedKernel(causal=True) computes key row >= query row (a window's lower edge), unmasked, in
    forward and backward, vs float64 with that mask; GQA included."""
    from megatron_ring.kernels.block import ReversedKernel

    torch.manual_seed(2)
    b, h, h_kv, n, d, scale = 2, 4, 2, 24, 16, 0.2
    q = torch.randn(b, h, n, d).double().requires_grad_()  # fp32 values: the kernels' inputs exactly
    k, v = (torch.randn(b, h_kv, n, d).double().requires_grad_() for _ in range(2))
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).tril(-1), float("-inf"))
    ref_out, ref_lse = torch.softmax(s, -1) @ v.repeat_interleave(2, 1), torch.logsumexp(s, -1)
    dout = torch.randn_like(ref_out).float().double()
    ref_out.backward(dout)
    _assert_kernel_matches(ReversedKernel(inner), q, k, v, True, scale, ref_out, ref_lse, dout)
