"""A kernel asked for by name that cannot run the case is refused at the first call with a ValueError that
names the reason and the fix, before any kernel runs -- never a crash inside a CUDA op. On fake CUDA with
a faked GPU architecture (the device seam's ``capability``): a pre-sm80 GPU for the fused kernels, head dims
a kernel does not take (cuDNN's 128, flash's 256, multiples of 8; MLA head dims count as the padded one),
dtypes, deterministic mode, and ``sdpa_cuda`` (refused until verified on a GPU). fp32 on CUDA runs on the
math kernel under ``auto``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring import device, ring_attention
from megatron_ring.kernels import block as K
from megatron_ring.transport.ring import LoopbackRing
from tests.fake_cuda.test_fake_cuda import Case, run_case
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda

# (kernel, GPU architecture, dtype, (d_qk, d_v), what the error must say)
REFUSED = [
    ("flash_cuda", (7, 5), torch.float16, (64, 64), "sm80 or newer GPU, this one is sm75"),
    ("cudnn", (7, 0), torch.float16, (64, 64), "sm80 or newer GPU, this one is sm70"),
    ("cudnn", (9, 0), torch.bfloat16, (192, 192), "at most 128, not 192"),
    ("cudnn", (9, 0), torch.bfloat16, (128, 192), "at most 128, not 192"),  # MLA: V's head dim, padded to
    ("flash_cuda", (9, 0), torch.bfloat16, (288, 288), "at most 256, not 288"),
    ("cudnn", (9, 0), torch.bfloat16, (100, 100), "multiple of 8"),
    ("flash_cuda", (9, 0), torch.float32, (64, 64), "fp16 or bf16, not torch.float32"),
    ("sdpa_cuda", (9, 0), torch.bfloat16, (64, 64), "not verified on a GPU"),
]
ALLOWED = [("flash_cuda", (8, 0), torch.float16, (64, 64)), ("cudnn", (9, 0), torch.bfloat16, (128, 64)),
           ("flash_cuda", (9, 0), torch.bfloat16, (256, 256))]


def _first_call(kernel, cap, dtype, dims, calls):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda(capability=cap)), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(2, 64, 4, dims[0], device="cuda", dtype=dtype)
        k = torch.randn(2, 64, 2, dims[0], device="cuda", dtype=dtype)
        v = torch.randn(2, 64, 2, dims[1], device="cuda", dtype=dtype)
        ring = LoopbackRing(2, 1, q.device)
        try:
            return ring_attention(q, k, v, causal=True, kernel=kernel, ring=ring)
        finally:
            calls.append(sum(n for n in _spied.values()))


_spied: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _count_kernel_runs(monkeypatch):
    _spied.clear()
    K._auto_choice.clear()
    for cls in (K.TorchFlashCudaKernel, K.CudnnKernel, K.CudaSDPAKernel):
        fwd = cls._fwd

        def spy(self, *a, _f=fwd):
            _spied[self.name] = _spied.get(self.name, 0) + 1
            return _f(self, *a)
        monkeypatch.setattr(cls, "_fwd", spy)
    yield
    K._auto_choice.clear()


@pytest.mark.parametrize("kernel, cap, dtype, dims, says", REFUSED, ids=lambda x: str(x).replace(" ", ""))
def test_a_kernel_that_cannot_run_the_case_is_refused_by_name(kernel, cap, dtype, dims, says):
    calls: list[int] = []
    with pytest.raises(ValueError, match=rf"(?s)kernel '{kernel}'.*{says}.*kernel='auto'"):
        _first_call(kernel, cap, dtype, dims, calls)
    assert calls == [0]  # refused before any kernel ran


@pytest.mark.parametrize("kernel, cap, dtype, dims", ALLOWED, ids=lambda x: str(x).replace(" ", ""))
def test_a_kernel_that_can_run_the_case_runs(kernel, cap, dtype, dims):
    """Not vacuous: the same path with a case the kernel takes runs it (the refusals are not blanket)."""
    calls: list[int] = []
    out = _first_call(kernel, cap, dtype, dims, calls)
    assert out.shape[-1] == dims[1] and calls[0] > 0


def test_deterministic_mode_refuses_the_kernels_without_a_deterministic_backward():
    K.set_deterministic(True)
    try:
        with pytest.raises(ValueError, match="no deterministic backward"):
            _first_call("flash_cuda", (9, 0), torch.bfloat16, (64, 64), [])
    finally:
        K.set_deterministic(None)


def test_determinism_is_a_property_of_the_call_not_of_the_process():
    """``deterministic=`` of one call wins over the process default, leaves it as it was, and ``auto``'s cached
    choice keys on it (a deterministic call never gets the choice of a non-deterministic one, nor back)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = K.deterministic()
    with device.use("cuda", FakeCuda(capability=(9, 0))), FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="no deterministic backward"):
            K.select_kernel(q, "flash_cuda", deterministic=True)
        free = K.select_kernel(q, "auto", deterministic=False)
        det = K.select_kernel(q, "auto", deterministic=True)
        assert free.name == "cudnn" and not free.is_deterministic()
        assert det.name not in ("cudnn", "flash_cuda") and det.is_deterministic()
        assert K.select_kernel(q, "auto", deterministic=False) is free  # the cache keeps both, apart
        K.set_deterministic(True)
        try:
            assert K.select_kernel(q, "auto") is det  # the process default, for a call that does not say
            assert K.select_kernel(q, "flash_cuda", deterministic=False).name == "flash_cuda"
        finally:
            K.set_deterministic(None)
    assert K.deterministic() == before


@pytest.mark.parametrize("cap, dtype", [((9, 0), torch.float32), ((7, 5), torch.float16)])
def test_auto_runs_what_no_fused_kernel_takes_on_the_math_kernel(cap, dtype):
    """fp32 on CUDA (and fp16 before sm80): no fused kernel takes it, sdpa_cuda is out of auto, so auto picks
    the math kernel -- forward and backward traced on fake CUDA, no fused kernel ran."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda(capability=cap)), FakeTensorMode():
        assert K.select_kernel(torch.empty(1, 4, 64, 64, device="cuda", dtype=dtype)).name == "math"
    K._auto_choice.clear()
    leaves, out, grads, checker, _ = run_case(Case(kernel="auto", dtype=dtype), dev=FakeCuda(capability=cap))
    assert out.dtype == dtype and all(grads[id(t)].shape == t.shape for t in leaves)
    assert _spied == {} and checker.problems == []
