"""The fake-CUDA tier's cases (tests/fake_cuda/test_fake_cuda.py, ``CASES``) for real on a GPU: real CUDA
tensors, real streams and events (the device seam's ``CudaOps``), the real autograd engine. Each case runs
forward and backward over the loopback transport and checks what the fake tier checks (shapes, dtypes,
devices, strides of the output and every gradient), plus finite values. Values against float64 are
checked by test_gpu_kernels_and_engine.py. Skipped without a GPU (tests/gpu/conftest.py)."""

import pytest
import torch

from tests.fake_cuda.test_fake_cuda import CASES, S_LOCAL  # noqa: E402

from megatron_ring import ring_attention  # noqa: E402
from megatron_ring.transport.ring import LoopbackRing  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fake_tier_case_on_a_gpu(case):
    from tests.fake_cuda.test_fake_cuda import _inputs

    q, k, v, kw, leaves = _inputs(case)
    try:
        out = ring_attention(q, k, v, ring=LoopbackRing(case.P, case.P // 2, q.device), **kw)
    except ValueError as exc:  # a forced kernel this GPU (architecture, cuDNN) does not support
        if "does not support" in str(exc):
            pytest.skip(str(exc))
        raise
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype and out.is_cuda
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for leaf in leaves:
        g = leaf.grad
        assert (g.shape, g.dtype, g.device) == (leaf.shape, leaf.dtype, leaf.device) and torch.isfinite(g).all()
    assert S_LOCAL > 0
