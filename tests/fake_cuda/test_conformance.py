"""Our CUDA kernels call torch's private attention backward ops exactly as torch's own autograd does.

For each native kernel of ``kernels/block.py`` (``flash_cuda``, ``cudnn``, ``sdpa_cuda``), under
``FakeTensorMode`` on fake CUDA tensors: torch's forward op runs with ``requires_grad`` inputs, its autograd
node is applied by hand (the autograd engine wants a real device), and a dispatch mode records the backward
op torch calls. Then our kernel's forward and backward run on the same inputs, with ``out`` and ``dout``
as the engine hands them over (contiguous BHSD; the lse ``[b, h, sq]`` fp32), and the backward call it makes
is recorded too. The two calls are compared argument by argument: defined or undefined (``None``), dtype,
shape, strides and device of each tensor, and every non-tensor value.

Why this matters: the meta kernels FakeTensorMode runs check shapes, not which optional tensors are
defined or which layout a kernel assumes. On a real GPU, defined empty ``cum_seq_q/k`` send the flash and
cuDNN backward down their variable-length path (an error), and the memory-efficient backward reads ``out``
with the row stride of the BSHD layout its forward produced whatever strides it is given (wrong gradients,
then an illegal memory access). Each of these is a difference this comparison reports.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ring import device
from megatron_ring.kernels import block as K
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda

SCALE = 0.125

#: kernel name -> (its class, torch's forward op called as torch's SDPA calls it, torch's backward op)
OPS = {
    "flash_cuda": (K.TorchFlashCudaKernel,
                   lambda q, k, v, c: torch.ops.aten._scaled_dot_product_flash_attention(
                       q, k, v, 0.0, c, False, scale=SCALE),
                   "aten::_scaled_dot_product_flash_attention_backward"),
    "cudnn": (K.CudnnKernel,
              lambda q, k, v, c: torch.ops.aten._scaled_dot_product_cudnn_attention(
                  q, k, v, None, True, 0.0, c, False, scale=SCALE),
              "aten::_scaled_dot_product_cudnn_attention_backward"),
    "sdpa_cuda": (K.CudaSDPAKernel,
                  lambda q, k, v, c: torch.ops.aten._scaled_dot_product_efficient_attention(
                      q, k, v, None, True, 0.0, c, scale=SCALE),
                  "aten::_scaled_dot_product_efficient_attention_backward"),
}


class BackwardRecorder(TorchDispatchMode):
    """Records the calls of the op named ``op`` (its positional and keyword arguments)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name == self.op:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), tuple(x.stride()), x.device.type)
    if isinstance(x, (list, tuple)):
        return type(x)(_describe(e) for e in x)
    return x


def differences(theirs, ours) -> list[str]:
    """Argument by argument (by position in the op's schema, keywords by name), where two recorded calls
    differ: defined or None, dtype, shape, strides, device, values."""
    (func, a1, k1), (func2, a2, k2) = theirs, ours
    if func is not func2:
        return [f"op: {func} vs {func2}"]
    out = []
    for i, arg in enumerate(func._schema.arguments):
        x = a1[i] if i < len(a1) else k1.get(arg.name, arg.default_value)
        y = a2[i] if i < len(a2) else k2.get(arg.name, arg.default_value)
        if _describe(x) != _describe(y):
            out.append(f"argument {i} ({arg.name}): torch {_describe(x)} vs ours {_describe(y)}")
    return out


def _qkv(b=2, h=4, s=40, d=64, dtype=torch.bfloat16):
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def torch_call(name: str, q, k, v, causal: bool, dout_of):
    """torch's forward op, then its autograd node applied to ``dout_of(out)``: the backward call recorded."""
    _, forward, op = OPS[name]
    out = forward(q, k, v, causal)[0]
    with torch.no_grad(), BackwardRecorder(op) as rec:
        out.grad_fn(dout_of(out))
    (call,) = rec.calls
    return call, out


def our_call(name: str, q, k, v, causal: bool, dout: torch.Tensor):
    """Our kernel's forward, then its backward with out/dout/lse as the engine passes them."""
    kern = OPS[name][0]()
    with torch.no_grad():
        out, lse = kern.forward(q, k, v, causal, SCALE)
        with BackwardRecorder(OPS[name][2]) as rec:
            kern.backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), causal, SCALE)
    (call,) = rec.calls
    return call


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return device.use("cuda", FakeCuda()), FakeTensorMode(allow_non_fake_inputs=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(OPS))
def test_our_backward_call_is_torchs(name, causal):
    seam, fake = _fake()
    with seam, fake:
        q, k, v = _qkv()
        dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)  # the engine's dout: contiguous BHSD
        # torch gets the same gradient, in the layout its autograd hands a gradient of `out` over
        theirs, _ = torch_call(name, q, k, v, causal, lambda o: torch.empty_like(o).copy_(dout))
        ours = our_call(name, q, k, v, causal, dout)
    assert differences(theirs, ours) == []


# today's (before the fix) calls, as they were: the comparison must report these very arguments
def _flash_as_before(dout, q, k, v, out, lse, causal):
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal, seed, empty, scale=SCALE)


def _cudnn_as_before(dout, q, k, v, out, lse, causal):
    empty, zero = q.new_empty(0), torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.reshape(*lse.shape, 1).contiguous(), zero, zero, empty, empty, empty,
        q.shape[2], k.shape[2], 0.0, causal, scale=SCALE)


def _sdpa_as_before(dout, q, k, v, out, lse, causal):
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    padded = lse.new_zeros(*lse.shape[:-1], -(-q.shape[2] // 32) * 32)
    padded[..., : q.shape[2]] = lse
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, zero, zero, 0.0, [True, True, True, False], causal, scale=SCALE)


@pytest.mark.parametrize("name, before, flagged", [
    ("flash_cuda", _flash_as_before, [6, 7, 12, 13]),
    ("cudnn", _cudnn_as_before, [8, 9, 10]),
    ("sdpa_cuda", _sdpa_as_before, [0, 5]),
])
def test_the_comparison_flags_the_calls_found_wrong_on_a_gpu(name, before, flagged):
    """Not vacuous: the backward calls that failed on an H200 (defined empty cum_seq_q/k and attn_bias,
    int64 RNG state; ``dout`` and ``out`` in BHSD memory for the memory-efficient op) differ from torch's call in exactly
    the arguments named in the GPU report."""
    seam, fake = _fake()
    with seam, fake:
        q, k, v = _qkv()
        dout = torch.randn(2, 4, 40, 64, device="cuda", dtype=torch.bfloat16)
        theirs, _ = torch_call(name, q, k, v, True, lambda o: torch.empty_like(o).copy_(dout))
        with torch.no_grad(), BackwardRecorder(OPS[name][2]) as rec:
            before(dout, q, k, v, *(t.contiguous() for t in OPS[name][0]().forward(q, k, v, True, SCALE)), True)
        found = differences(theirs, rec.calls[0])
    assert [int(d.split()[1]) for d in found] == flagged, found
