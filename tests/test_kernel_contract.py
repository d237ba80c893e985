"""The block-kernel contract on CPU: causal means top-left also for sq != sk, and kernels whose library
aligns bottom-right only ever see square causal or full blocks; supports() makes `auto` fall back."""
import pytest
import torch

from tests.helpers.numerics import grad_terms, lse_tol, max_err, score_bound, tol
from megatron_ring.kernels import block as K


class _SquareOnlyMath(K._SquareCausal):
    """A library stand-in that refuses rectangular causal blocks (as if it aligned them bottom-right)."""

    name = "square_only"
    seen = []

    def _fwd(self, q, k, v, causal, scale):
        assert not causal or q.shape[2] == k.shape[2], "a rectangular causal block reached the library"
        self.seen.append((q.shape[2], k.shape[2], causal))
        return K.MathKernel().forward(q, k, v, causal, scale)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        assert not causal or q.shape[2] == k.shape[2]
        return K.MathKernel().backward(dout, q, k, v, out, lse, causal, scale)


def _reference(q, k, v, causal, scale):
    """float64 attention with the top-left causal mask (key j visible to query i iff j <= i)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    s = s * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
    return out, lse


@pytest.mark.parametrize("sq, sk", [(8, 8), (5, 12), (12, 5), (1, 7), (7, 1)])
@pytest.mark.parametrize("kernel", [K.MathKernel(), K.FlashCPUKernel(), _SquareOnlyMath()], ids=lambda k: k.name)
def test_causal_is_top_left_for_every_shape(kernel, sq, sk):
    torch.manual_seed(sq * 31 + sk)
    q = torch.randn(2, 4, sq, 16, requires_grad=True)
    k = torch.randn(2, 2, sk, 16, requires_grad=True)
    v = torch.randn(2, 2, sk, 16, requires_grad=True)
    out, lse = kernel.forward(q, k, v, True, 0.25)
    ref_out, ref_lse = _reference(q, k, v, True, 0.25)
    # fp32 kernels against float64: the derived bound (tests/helpers/numerics.py)
    kw = dict(dtype=torch.float32, n=max(sq, sk, 16), sigma=score_bound(q, k, 0.25))
    assert max_err(out, ref_out) <= tol(ref_out.abs().max().item(), **kw)
    assert max_err(lse, ref_lse) <= lse_tol(ref_lse, **kw)
    dout = torch.randn_like(ref_out).float().double()  # fp32 values: the kernel's dout exactly
    grads = kernel.backward(dout.float(), q.detach(), k.detach(), v.detach(), ref_out.float().detach(),
                            ref_lse.float().detach(), True, 0.25)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    # sq or sk == 1: every query sees one key, dq and dk cancel to 0: M is the size of their terms
    terms = grad_terms(q, k, v, dout, 0.25, n=sq)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        m = max(r.abs().max().item(), terms if name != "dv" else 0.0)
        assert max_err(g, r) <= tol(m, **kw), name


def test_causal_sub_blocks_cover_exactly_the_visible_keys():
    for sq in range(1, 9):
        for sk in range(1, 9):
            mask = torch.zeros(sq, sk, dtype=torch.bool)
            for rows, cols, causal in K.causal_sub_blocks(sq, sk, True):
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
                if causal:
                    assert block.shape[0] == block.shape[1]
                    block = block.tril()
                assert not (mask[rows, cols] & block).any()
                mask[rows, cols] |= block
            assert torch.equal(mask, torch.ones(sq, sk, dtype=torch.bool).tril()), (sq, sk)


def test_cuda_kernels_decline_cpu_tensors_and_auto_falls_back():
    q = torch.randn(1, 2, 8, 16)
    for name in ("sdpa_cuda", "flash_attn", "flash_cuda", "cudnn", "te_fused"):
        assert not K.KERNELS[name]().supports(q), name
        with pytest.raises(ValueError, match="not verified on a GPU" if name == "sdpa_cuda" else "does not support"):
            K.select_kernel(q, name)
    assert K.select_kernel(q).name == "flash_cpu"
    assert K.select_kernel(q.to(torch.float16)).name in ("flash_cpu", "math")


def test_deterministic_mode_follows_torch_and_can_be_forced():
    assert K.deterministic() == torch.are_deterministic_algorithms_enabled()
    K.set_deterministic(True)
    try:
        assert K.deterministic()
    finally:
        K.set_deterministic(None)
