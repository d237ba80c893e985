"""Which masked tasks run on the variable-length flash kernel on CUDA and which fall back to the math kernel
(kernels/varlen.py): fp16/bf16 on sm80+ run on it; fp32, an sm75 GPU and deterministic mode (as the dense
``flash_cuda``) fall back, counted in ``varlen.COUNTS``. Traced on fake CUDA (nothing is computed)."""
from __future__ import annotations

import pytest
import torch

from megatron_ring import device
from megatron_ring.kernels import block as K
from megatron_ring.kernels import varlen as V
from tests.fake_cuda.test_conformance import _block_mask
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda


@pytest.mark.parametrize("dtype, capability, deterministic, want", [
    (torch.bfloat16, (9, 0), False, "varlen_cuda"),
    (torch.float16, (8, 0), False, "varlen_cuda"),
    (torch.float32, (9, 0), False, "math"),
    (torch.bfloat16, (7, 5), False, "math"),
    (torch.bfloat16, (9, 0), True, "math"),
])
def test_masked_tasks_on_cuda_run_on_the_varlen_kernel_where_it_fits(dtype, capability, deterministic, want):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mask = _block_mask(True, (0, 5, 20, 40), None)
    kern = V.masked_kernel(K.TorchFlashCudaKernel())
    assert kern.name == "varlen_cuda"
    V.COUNTS.clear()
    K.set_deterministic(deterministic)
    try:
        with device.use("cuda", FakeCuda(capability=capability)), FakeTensorMode(allow_non_fake_inputs=True):
            q, k, v = (torch.randn(1, 4, 40, 64, device="cuda", dtype=dtype) for _ in range(3))
            out, lse = kern.forward(q, k, v, False, 0.125, mask=mask)
            grads = kern.backward(torch.randn_like(out), q, k, v, out, lse, False, 0.125, mask=mask)
    finally:
        K.set_deterministic(None)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:3]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert dict(V.COUNTS) == {want: 2}, V.COUNTS


def test_the_calls_determinism_reaches_the_varlen_kernel():
    """Determinism is the call's (``ring_attention(deterministic=)`` sets it on the plan's kernel): the masked
    tasks' kernel has the same flag, so a deterministic call's masked tasks fall back to the math kernel and a
    call that says False keeps them on the variable-length kernel whatever the process default."""
    for det in (True, False, None):
        dense = K.TorchFlashCudaKernel()
        dense.deterministic = det
        assert V.masked_kernel(dense).deterministic is det
    K.set_deterministic(True)
    try:
        dense = K.TorchFlashCudaKernel()
        dense.deterministic = False
        assert not V.masked_kernel(dense).is_deterministic()
    finally:
        K.set_deterministic(None)


def test_the_kernels_own_masked_tasks_stay_where_they_are():
    """A kernel that takes masks keeps its masked tasks (CPU flash, math); on CPU the stand-in takes them
    only when asked (``cpu_stand_in``)."""
    for name in ("flash_cpu", "math"):
        kernel = K.KERNELS[name]()
        assert V.masked_kernel(kernel) is kernel
        with V.cpu_stand_in():
            assert V.masked_kernel(kernel).name == "varlen_cpu"
