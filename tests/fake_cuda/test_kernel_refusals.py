"""A kernel asked for by name that cannot run the case is refused at the first call with a ValueError that
names the reason and the fix, before any kernel runs -- never a crash inside a CUDA op. On fake CUDA with
a faked GPU architecture (the device seam's ``capability``): a pre-sm80 GPU for the fused kernels, head dims
a kernel does not take (cuDNN's 128, flash's 256; MLA head dims, and head dims that are not a multiple of 8,
count as the padded one: those run, padded; MLA head dims run on cuDNN as they are where torch's own SDPA hands
them to it),
dtypes, deterministic mode, and ``sdpa_cuda`` (refused until verified on a GPU). fp32 on CUDA runs on the
math kernel under ``auto``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring import device, ring_attention
from megatron_ring.kernels import block as K
from megatron_ring.transport.ring import LoopbackRing
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fake_cuda.test_fake_cuda import Case, fake_backward, run_case
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda

# (kernel, GPU architecture, dtype, (d_qk, d_v), what the error must say)
REFUSED = [
    ("flash_cuda", (7, 5), torch.float16, (64, 64), "sm80 or newer GPU, this one is sm75"),
    ("cudnn", (7, 0), torch.float16, (64, 64), "sm80 or newer GPU, this one is sm70"),
    ("cudnn", (9, 0), torch.bfloat16, (192, 192), "at most 128, not 192"),
    ("cudnn", (9, 0), torch.bfloat16, (128, 192), "at most 128, not 192"),  # MLA: V's head dim, padded to
    ("flash_cuda", (9, 0), torch.bfloat16, (288, 288), "at most 256, not 288"),
    ("cudnn", (9, 0), torch.bfloat16, (130, 130), r"head dim 130 \(padded to 136\).*at most 128, not 136"),
    ("flash_cuda", (9, 0), torch.bfloat16, (250, 258), r"at most 256, not 264"),
    ("flash_cuda", (9, 0), torch.float32, (64, 64), "fp16 or bf16, not torch.float32"),
    ("sdpa_cuda", (9, 0), torch.bfloat16, (64, 64), "not verified on a GPU"),
    # torch's dispatcher refuses its flash backward there (sdp_utils: ..._head_dim_gt192_..._on_sm86_89_or_120)
    ("flash_cuda", (8, 9), torch.bfloat16, (224, 224), "does not run head dim 224 on sm89"),
    ("flash_cuda", (8, 6), torch.bfloat16, (200, 200), "does not run head dim 200 on sm86"),
    ("flash_cuda", (12, 0), torch.float16, (208, 208), "does not run head dim 208 on sm120"),
]
ALLOWED = [("flash_cuda", (8, 0), torch.float16, (64, 64)), ("cudnn", (9, 0), torch.bfloat16, (128, 64)),
           ("flash_cuda", (9, 0), torch.bfloat16, (256, 256)), ("flash_cuda", (9, 0), torch.bfloat16, (224, 224)),
           ("flash_cuda", (8, 9), torch.bfloat16, (192, 192)), ("flash_cuda", (8, 9), torch.bfloat16, (256, 256)),
           # head dims that are not a multiple of 8: the operands zero-padded to one (kernels/head_dim.py)
           ("cudnn", (9, 0), torch.bfloat16, (100, 100)), ("cudnn", (9, 0), torch.bfloat16, (121, 100)),
           ("flash_cuda", (9, 0), torch.bfloat16, (250, 250))]


def _first_call(kernel, cap, dtype, dims, calls, **seam):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda(capability=cap, **seam)), FakeTensorMode(allow_non_fake_inputs=True):
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


@pytest.mark.parametrize("dims", [(192, 128), (128, 192), (64, 32)], ids=str)
def test_mla_head_dims_run_on_cudnn_as_they_are_where_torch_hands_them_to_it(dims):
    """Where torch's own SDPA hands cuDNN V of another head dim (the device seam: torch's rule), ``kernel="cudnn"``
    and ``auto`` run cuDNN on them unpadded, 192/128 included (beyond the 128 of one padded head dim); where it does
    not, ``auto`` runs torch's flash kernel padded and ``kernel="cudnn"`` is refused past 128, naming both reasons;
    in deterministic mode neither way runs cuDNN."""
    seen = []

    class Dims(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.overloadpacket.__name__ and "backward" not in func.overloadpacket.__name__:
                seen.append((func.overloadpacket.__name__.split("_")[4], args[0].shape[-1], args[2].shape[-1]))
            return func(*args, **(kwargs or {}))

    with Dims():
        out = _first_call("cudnn", (9, 0), torch.bfloat16, dims, [], head_dims=True)
        assert out.shape[-1] == dims[1] and set(seen) == {("cudnn", *dims)}, seen
        seen.clear()
        K._auto_choice.clear()
        _first_call("auto", (9, 0), torch.bfloat16, dims, [], head_dims=True)
        assert set(seen) == {("cudnn", *dims)}, seen
        seen.clear()
        K._auto_choice.clear()
        _first_call("auto", (9, 0), torch.bfloat16, dims, [], head_dims=False)
        d = max(dims)
        assert set(seen) == {("cudnn" if d <= 128 else "flash", d, d)}, seen
    if max(dims) > 128:
        with pytest.raises(ValueError, match=rf"at most 128, not {max(dims)} \(MLA head dims {dims[0]}/{dims[1]} as "
                                             r"they are: torch's own SDPA does not hand cuDNN"):
            _first_call("cudnn", (9, 0), torch.bfloat16, dims, [], head_dims=False)
    K.set_deterministic(True)
    try:
        with pytest.raises(ValueError, match="no deterministic backward"):
            _first_call("cudnn", (9, 0), torch.bfloat16, dims, [], head_dims=True)
    finally:
        K.set_deterministic(None)


def test_deterministic_mode_refuses_the_kernels_without_a_deterministic_backward():
    K.set_deterministic(True)
    try:
        with pytest.raises(ValueError, match="no deterministic backward"):
            _first_call("cudnn", (9, 0), torch.bfloat16, (64, 64), [])
        with pytest.raises(ValueError, match=r"deterministic only under torch.use_deterministic_algorithms"):
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
        with pytest.raises(ValueError, match="deterministic only under"):
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


class _CudnnShapes(TorchDispatchMode):
    """Records (query rows, keys) of every cuDNN attention op, and counts the flash ones."""

    def __init__(self):
        super().__init__()
        self.cudnn, self.flash = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "cudnn_attention" in name:
            self.cudnn.append((args[1].shape[2], args[2].shape[2]) if "backward" in name
                              else (args[0].shape[2], args[1].shape[2]))
        elif "flash_attention" in name:
            self.flash += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout, s_local, cap, heads", [("zigzag", 2, (9, 0), (4, 2)), ("striped", 1, (9, 0), (4, 4)),
                                                       ("contiguous", 1, (8, 0), (4, 2)),
                                                       ("contiguous", 1, (10, 0), (8, 2))])
def test_cudnn_blocks_it_must_not_run_go_to_flash(layout, s_local, cap, heads):
    """Blocks of one key (a zigzag half of one row; one row per rank), which torch's dispatcher never gives cuDNN
    (``check_cudnn_tensor_shapes``: a cuDNN frontend error), and blocks of one query row on sm100 (wrong numbers
    with few K/V heads on cuDNN 9.19/9.20), run on torch's flash kernel, forward and backward; no cuDNN op sees
    them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda(capability=cap)), FakeTensorMode(allow_non_fake_inputs=True):
        h, hk = heads
        q = torch.randn(1, s_local, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, s_local, hk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        with _CudnnShapes() as seen:
            out = ring_attention(q, k, v, causal=True, layout=layout, kernel="cudnn", ring=LoopbackRing(2, 1, q.device))
            fake_backward(out, torch.ones_like(out), [q, k, v])
    one_row = cap >= (10, 0)
    assert all(sk != 1 and not (one_row and sq == 1) for sq, sk in seen.cudnn), seen.cudnn
    assert seen.flash >= 2  # a forward and a backward at least


def test_the_cudnn_shape_rule_is_not_vacuous(monkeypatch):
    """Negative control: without the rule the same block of one key goes to cuDNN."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(K.CudnnKernel, "_instead", lambda self, q, k, v: None)
    with device.use("cuda", FakeCuda(capability=(9, 0))), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(1, 4, 2, 64, device="cuda", dtype=torch.bfloat16)
        with _CudnnShapes() as seen:
            K.CudnnKernel().forward(q, q[:, :, :1], q[:, :, :1], False, 0.125)
    assert seen.cudnn == [(2, 1)] and seen.flash == 0


@pytest.mark.parametrize("off, name", [("cudnn", "flash_cuda"), ("flash", "cudnn"), ("both", "math")])
def test_auto_honours_torchs_sdpa_switches(off, name):
    """A backend turned off in torch (``torch.nn.attention.sdpa_kernel``, ``enable_*_sdp(False)``) is not picked by
    ``auto``, and named when asked for; back on, ``auto`` picks cuDNN again (its cached choice keys on the
    switches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    flags = {"cudnn": (True, False), "flash": (False, True), "both": (False, False)}[off]
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    with device.use("cuda", FakeCuda(capability=(9, 0))), FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
        assert K.select_kernel(q).name == "cudnn"
        torch.backends.cuda.enable_flash_sdp(flags[0])
        torch.backends.cuda.enable_cudnn_sdp(flags[1])
        try:
            assert K.select_kernel(q).name == name
            if off != "both":
                with pytest.raises(ValueError, match=f"torch's {off} attention is turned off"):
                    K.select_kernel(q, "cudnn" if off == "cudnn" else "flash_cuda")
        finally:
            torch.backends.cuda.enable_flash_sdp(before[0])
            torch.backends.cuda.enable_cudnn_sdp(before[1])
        assert K.select_kernel(q).name == "cudnn"


@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_calls_run_flash_under_torchs_strict_deterministic_mode(warn_only):
    """torch's flash backward (dense and variable-length) runs its deterministic algorithm under
    ``torch.use_deterministic_algorithms(True)`` (what Megatron's --deterministic-mode sets): a deterministic call
    runs on it there, not on the materialising math kernel; under ``warn_only`` torch's flash backward is not
    deterministic, and the call stays off it. Asked for by name without torch's mode: refused, naming it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from megatron_ring.kernels.varlen import VarlenFlashCudaKernel

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    with device.use("cuda", FakeCuda(capability=(9, 0))), FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"deterministic only under torch.use_deterministic_algorithms\(True\)"):
            K.select_kernel(q, "flash_cuda", deterministic=True)
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        try:
            chosen = K.select_kernel(q, "auto", deterministic=True)
            varlen = VarlenFlashCudaKernel()
            varlen.deterministic = True
            assert (chosen.name == "flash_cuda") == (not warn_only), chosen.name
            assert chosen.is_deterministic()
            assert varlen.fits(q, 64) == (not warn_only)
        finally:
            torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])
        assert K.select_kernel(q, "auto", deterministic=True).name == "math"  # the cached choice keys on torch's mode


class _AttentionCalls(TorchDispatchMode):
    """(op, head dims of q, k, v, scale) of every fused attention op called, forward and backward."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name and name.startswith("_"):
            qkv = args[1:4] if "backward" in name else args[0:3]
            self.calls.append((name, tuple(t.shape[-1] for t in qkv), (kwargs or {}).get("scale")))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_a_head_dim_that_is_not_a_multiple_of_8_runs_fused_and_padded(fmt):
    """Head dim 100 under ``auto`` on an sm90: cuDNN (for packed documents, torch's variable-length flash kernel)
    runs it, forward and backward, with every operand zero-padded to 104 and the call's softmax scale
    (1/sqrt(100)), as torch's SDPA runs it on flash; before, it ran on the math kernel. The numbers of that
    padding are checked on CPU (tests/test_head_dim_padding.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tests.fake_cuda.test_fake_cuda import _inputs, _plan_on_host

    case = Case(kernel="auto", fmt=fmt, layout="striped", dims=(100, 100))
    _plan_on_host(case, 1)
    with device.use("cuda", FakeCuda(capability=(9, 0))), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, kw, leaves = _inputs(case)
        with _AttentionCalls() as seen:
            out = ring_attention(q, k, v, ring=LoopbackRing(case.P, 1, q.device), **kw)
            fake_backward(out, torch.ones_like(out), leaves)
    assert out.shape == q.shape
    names = {name for name, _, _ in seen.calls}
    want = {"_flash_attention_forward", "_flash_attention_backward"} if fmt == "thd" else \
        {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"}
    assert want <= names, names  # (this rank's blocks of documents are all masked: the variable-length kernel)
    assert {(dims, scale) for _, dims, scale in seen.calls} == {((104, 104, 104), 100 ** -0.5)}, seen.calls
