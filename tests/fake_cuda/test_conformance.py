"""Our CUDA kernels call torch's private attention backward ops exactly as torch's own autograd does.

For each native kernel of ``kernels/block.py`` (``flash_cuda``, ``cudnn``, ``sdpa_cuda``), under
``FakeTensorMode`` on fake CUDA tensors: torch's forward op runs with ``requires_grad`` inputs, its autograd
node is applied by hand (the autograd engine wants a real device), and a dispatch mode records the backward
op torch calls. Then our kernel's forward and backward run on the same inputs, with ``out`` and ``dout``
as the engine hands them over (contiguous BHSD; the lse ``[b, h, sq]`` fp32), and the backward call it makes
is recorded too. The two calls are compared argument by argument: defined or undefined (``None``), dtype,
shape, strides and device of each tensor, and every non-tensor value.

The same comparison runs on every backward call a whole ring makes (``ring_attention`` on the loopback
transport: BSHD and SBHD, zigzag and striped, GQA, fp16, windows), against torch's call for that call's q, k,
v and dout; the only difference allowed there is in the strides of ``out``/``dout`` when the engine hands
over a task's rows, or a K/V piece's heads, as a view of a larger buffer in the same memory order
(``_same_layout_view``).

The variable-length flash kernel of masked tasks (``kernels/varlen.py``: ``aten._flash_attention_forward`` /
``_flash_attention_backward`` with ``cum_seq_q/k`` and a window) is compared the same way, call by call: each
forward call it makes is repeated with ``requires_grad`` inputs and torch's autograd node gives the backward
call ours must equal; the same runs on every call a whole ring makes on packed documents (padded and MLA head dims
included), each backward call paired with the forward call of the same task.

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
                   lambda q, k, v, c, scale=SCALE: torch.ops.aten._scaled_dot_product_flash_attention(
                       q, k, v, 0.0, c, False, scale=scale),
                   "aten::_scaled_dot_product_flash_attention_backward"),
    "cudnn": (K.CudnnKernel,
              lambda q, k, v, c, scale=SCALE: torch.ops.aten._scaled_dot_product_cudnn_attention(
                  q, k, v, None, True, 0.0, c, False, scale=scale),
              "aten::_scaled_dot_product_cudnn_attention_backward"),
    "sdpa_cuda": (K.CudaSDPAKernel,
                  lambda q, k, v, c, scale=SCALE: torch.ops.aten._scaled_dot_product_efficient_attention(
                      q, k, v, None, True, 0.0, c, scale=scale),
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


def differing(theirs, ours) -> list[tuple[int, str, object, object]]:
    """Argument by argument (by position in the op's schema, keywords by name), where two recorded calls
    differ: ``(position, name, torch's, ours)`` described as defined or None, dtype, shape, strides, device,
    values."""
    (func, a1, k1), (func2, a2, k2) = theirs, ours
    assert func is func2, (func, func2)
    out = []
    for i, arg in enumerate(func._schema.arguments):
        x = a1[i] if i < len(a1) else k1.get(arg.name, arg.default_value)
        y = a2[i] if i < len(a2) else k2.get(arg.name, arg.default_value)
        if _describe(x) != _describe(y):
            out.append((i, arg.name, _describe(x), _describe(y)))
    return out


def differences(theirs, ours) -> list[str]:
    return [f"argument {i} ({n}): torch {x} vs ours {y}" for i, n, x, y in differing(theirs, ours)]


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


def _fake(**seam):
    from torch._subclasses.fake_tensor import FakeTensorMode
    return device.use("cuda", FakeCuda(**seam)), FakeTensorMode(allow_non_fake_inputs=True)


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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["cudnn", "flash_cuda"])
def test_our_gqa_call_is_torchs(name, causal):
    """GQA (8 query heads on 2 K/V heads) where torch's SDPA takes it as it is (the device seam says so): torch's
    own call is the op on the un-expanded K/V (what SDPA with ``enable_gqa=True`` dispatches), and ours equals
    it. Negative control: where the seam says no (a torch whose cuDNN path refuses GQA), ours expands K/V, and
    the comparison reports exactly the key and value arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for takes, flagged in ((True, []), (False, ["key", "value"])):
        with device.use("cuda", FakeCuda(gqa=takes)), FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.randn(2, 8, 40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
            theirs, _ = torch_call(name, q, k, v, causal, lambda o: torch.empty_like(o).copy_(dout))
            ours = our_call(name, q, k, v, causal, dout)
            grads = OPS[name][0]().backward(dout, q, k, v, *OPS[name][0]().forward(q, k, v, causal, SCALE),
                                            causal, SCALE)
        assert [n for _, n, _, _ in differing(theirs, ours)] == flagged, (takes, differences(theirs, ours))
        assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", [(192, 128), (64, 32), (64, 128)])
def test_our_mla_cudnn_call_is_torchs(dims, causal):
    """MLA head dims (V's differs from Q/K's) on cuDNN, where torch's SDPA hands them to cuDNN as they are (the
    device seam says so; torch's ``check_cudnn_tensor_shapes`` takes ``d_qk != d_v``): our forward returns V's head
    dim, and our backward call equals torch's, argument by argument, GQA included."""
    dqk, dv = dims
    with device.use("cuda", FakeCuda(head_dims=True)), __import__(
            "torch._subclasses.fake_tensor", fromlist=["FakeTensorMode"]).FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(2, 8, 40, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 40, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 40, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(2, 8, 40, dv, device="cuda", dtype=q.dtype)
        theirs, out = torch_call("cudnn", q, k, v, causal, lambda o: torch.empty_like(o).copy_(dout))
        ours = our_call("cudnn", q, k, v, causal, dout)
    assert tuple(out.shape) == (2, 8, 40, dv)
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


# --- in the engine: every backward call a ring makes, against torch's call on the same q, k, v, dout --------

def _torch_call_on(name: str, call):
    """torch's own backward call for the q, k, v, dout and softmax scale of one of our recorded calls."""
    func, args, kwargs = call
    values = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    causal = values.get("is_causal", False)  # a trailing default is left out of the recorded call
    with torch.enable_grad():
        q, k, v = (values[n].detach().requires_grad_() for n in ("query", "key", "value"))
        out = OPS[name][1](q, k, v, causal, values["scale"])[0]
    dout = args[0]
    with torch.no_grad(), BackwardRecorder(OPS[name][2]) as rec:
        out.grad_fn(torch.empty_like(out).copy_(dout))
    return rec.calls[0]


def _same_layout_view(diff) -> bool:
    """A difference in the strides alone of ``out`` / ``dout``, in the same memory order: the engine hands a
    kernel the rows of a task, or the heads of a K/V piece, as a view of a larger buffer in the layout torch's
    forward gives ``out`` (q's), which the flash and cuDNN ops take as they are (their strides are
    parameters); torch's autograd has a buffer per call. Another memory order is a difference: cuDNN keys
    its cached plans on q, k and v, not on ``out``'s layout (the ``head_chunks`` case that failed on a GPU)."""
    _, name, theirs, ours = diff
    if name not in ("grad_out", "out") or theirs[:3] != ours[:3] or theirs[4:] != ours[4:]:
        return False
    dims = [i for i, n in enumerate(theirs[2]) if n > 1]  # a dim of one element: its stride says nothing
    order = lambda strides: sorted(dims, key=lambda i: -strides[i])  # noqa: E731
    return order(theirs[3]) == order(ours[3]) and all(ours[3][i] >= theirs[3][i] for i in dims)


ENGINE_CASES = [dict(P=2), dict(P=2, fmt="sbhd", causal=False), dict(P=4, heads=(8, 2)),
                dict(P=2, dtype=torch.float16, layout="striped"), dict(P=4, window=(40, 0)),
                dict(P=2, heads=(8, 4), head_chunks=2), dict(P=4, heads=(8, 4), kv_pieces=2),
                dict(P=2, fmt="sbhd", heads=(8, 4), head_chunks=2),
                # head dims the kernels do not take, zero-padded (kernels/head_dim.py): both sides, or one side
                # (MLA), whose padded operand keeps its memory order (a BHSD ``out`` once, for BSHD q); K/V pieces
                # of one head
                dict(P=2, dims=(100, 100)), dict(P=2, dims=(128, 64)), dict(P=4, fmt="sbhd", dims=(120, 128)),
                dict(P=2, heads=(2, 2), kv_pieces=2)]


def engine_differences(name: str, case: dict, seam: dict | None = None, calls: list | None = None) -> list:
    """The differences (``differing``) of every backward call a ring makes for ``case`` from torch's (``seam``: the
    fake device's answers, :class:`~tests.helpers.fake_device.FakeCuda`; ``calls``: gets the recorded calls)."""
    from tests.fake_cuda.test_fake_cuda import Case, _inputs, _kernel_arg, _plan_on_host, fake_backward
    from megatron_ring import ring_attention
    from megatron_ring.transport.ring import LoopbackRing

    c = Case(kernel=name, **case)
    rank = c.P // 2
    _plan_on_host(c, rank)
    seam, fake = _fake(**(seam or {}))
    with seam, fake:
        q, k, v, kw, leaves = _inputs(c)
        kw["kernel"] = _kernel_arg(name)
        out = ring_attention(q, k, v, ring=LoopbackRing(c.P, rank, q.device), **kw)
        with BackwardRecorder(OPS[name][2]) as rec:
            fake_backward(out, torch.randn_like(out), leaves)
        assert rec.calls
        if calls is not None:
            calls.extend(rec.calls)
        return [d for call in rec.calls for d in differing(_torch_call_on(name, call), call)]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("name", sorted(OPS))
def test_the_engine_calls_each_backward_as_torch_would(name, case):
    """Through ``ring_attention`` (fake CUDA, loopback ring): each backward call the ring makes equals the
    call torch's autograd makes for the same q, k, v and dout, up to the strides of a view in the same memory
    order (``_same_layout_view``): row slices, K/V pieces, and the head chunks, whose output the forward once
    allocated in BHSD order whatever q's layout (non-finite cuDNN gradients on a GPU after other cases)."""
    assert [d for d in engine_differences(name, case) if not _same_layout_view(d)] == []


@pytest.mark.parametrize("case", [dict(P=2, dims=(192, 128)), dict(P=4, heads=(8, 2), dims=(128, 64)),
                                  dict(P=2, fmt="sbhd", causal=False, dims=(64, 128)),
                                  dict(P=2, heads=(4, 4), dims=(192, 128), kv_pieces=2),
                                  dict(P=4, fmt="thd", heads=(8, 2), dims=(128, 64)),
                                  dict(P=2, dims=(192, 128), wire="fp8"), dict(P=4, window=(40, 0), dims=(64, 128))],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_engine_runs_mla_head_dims_on_cudnn_as_they_are(case):
    """Where torch's SDPA hands cuDNN MLA head dims as they are, the ring does too: every cuDNN backward call has
    Q/K and V of their own head dims (nothing padded) and equals torch's call. Negative control: where torch's
    rule says no, the same ring pads (every call has one head dim, the larger), or, for 192, which cuDNN takes only
    as they are (torch: sm90/sm100, cuDNN 9.11 on), refuses ``kernel="cudnn"`` naming both reasons."""
    dqk, dv = case["dims"]
    for takes, want in ((True, {(dqk, dv)}), (False, {(max(dqk, dv), max(dqk, dv))})):
        calls = []
        if not takes and max(dqk, dv) > 128:
            with pytest.raises(ValueError, match=r"at most 128, not 192 \(MLA head dims 192/128 as they are: torch's "
                                                 r"own SDPA does not hand cuDNN"):
                engine_differences("cudnn", case, seam=dict(head_dims=takes))
            continue
        found = engine_differences("cudnn", case, seam=dict(head_dims=takes), calls=calls)
        assert [d for d in found if not _same_layout_view(d)] == [], (takes, found)
        assert {(c[1][1].shape[-1], c[1][3].shape[-1]) for c in calls} == want, takes


def test_the_engine_comparison_flags_the_calls_found_wrong_on_a_gpu(monkeypatch):
    """Not vacuous: with the flash kernel's backward called as before, the engine's calls differ from
    torch's in the arguments the GPU report names."""
    monkeypatch.setattr(K.TorchFlashCudaKernel, "_bwd", lambda self, dout, q, k, v, out, lse, causal, scale:
                        _flash_as_before(dout, q, k, v, out, lse, causal))
    found = engine_differences("flash_cuda", dict(P=2, heads=(4, 4)))
    assert sorted({d[0] for d in found if not _same_layout_view(d)}) == [6, 7, 12, 13], found


# --- the variable-length flash kernel of masked tasks (kernels/varlen.py) ---------------------------------

VARLEN_OP = "aten::_flash_attention_backward"
VARLEN_MASKS = [(True, (0, 5, 20, 40), None), (False, (0, 5, 20, 37), None), (True, None, (7, 0)),
                (False, (0, 13, 40), (6, 3)), (True, (0, 30, 50, 80), None, 20)]  # the last: two calls


def _block_mask(causal, cu, window, q_from=0, s=40):
    """A masked task: query rows at global positions ``q_from..q_from+s-1``, key rows at ``0..s-1`` (documents
    ``cu``, ``window``), its plan built on the host (before the fake mode: it would make the host vectors
    fake)."""
    from megatron_ring.kernels.varlen_plan import plan_for
    from megatron_ring.schedules.masks import AttentionMask, BlockMask

    rule = AttentionMask(causal, cu, window)
    pos, qpos = torch.arange(s), torch.arange(q_from, q_from + s)
    mask = BlockMask(rule, qpos, rule.doc_ids(qpos), pos, rule.doc_ids(pos))
    assert plan_for(mask) is not None
    return mask


def _values(call) -> dict:
    func, args, kwargs = call
    return dict(zip((a.name for a in func._schema.arguments), args), **kwargs)


def _varlen_torch_call(forward_call, backward_call):
    """torch's own backward call for one of our kernel's calls: our recorded forward call
    (``_flash_attention_forward``) repeated with ``requires_grad`` inputs, then its autograd node applied to
    the dout of our backward call."""
    func, args, kwargs = forward_call
    with torch.enable_grad():
        args = [a.detach().requires_grad_() if i < 3 else a for i, a in enumerate(args)]
        out = func(*args, **kwargs)[0]
    with torch.no_grad(), BackwardRecorder(VARLEN_OP) as rec:
        out.grad_fn(torch.empty_like(out).copy_(_values(backward_call)["grad_out"]))
    (theirs,) = rec.calls
    return theirs


def varlen_differences(mask, bwd=None, b=2) -> list:
    """Differences of each backward call our variable-length kernel makes for ``mask`` (a batch of ``b``, GQA 4/2
    heads) from torch's call on the same inputs; ``bwd`` replaces the kernel's ``_bwd`` (a negative control)."""
    from megatron_ring.kernels.varlen import VarlenFlashCudaKernel

    kern = VarlenFlashCudaKernel()
    if bwd is not None:
        kern._bwd = bwd.__get__(kern)
    seam, fake = _fake()
    with seam, fake:
        q = torch.randn(b, 4, 40, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, 2, 40, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
        with torch.no_grad():
            with BackwardRecorder("aten::_flash_attention_forward") as fwd:
                out, lse = kern.forward(q, k, v, False, SCALE, mask=mask)
            with BackwardRecorder(VARLEN_OP) as rec:
                kern.backward(dout, q, k, v, out.contiguous(), lse.contiguous(), False, SCALE, mask=mask)
        assert rec.calls and len(rec.calls) == len(fwd.calls)
        return [d for f, call in zip(fwd.calls, rec.calls) for d in differing(_varlen_torch_call(f, call), call)]


@pytest.mark.parametrize("mask", VARLEN_MASKS)
def test_the_varlen_backward_call_is_torchs(mask):
    """Each ``_flash_attention_backward`` call of a masked task (packed rows of a batch of 2, GQA, documents,
    windows, causal and not) equals torch's autograd call for the same forward: defined tensors, dtypes
    (int32 cumulative lengths), shapes and strides (the lse ``[heads, rows]``), the forward's rng outputs, the
    window and scale."""
    assert varlen_differences(_block_mask(*mask)) == []


@pytest.mark.parametrize("mask", VARLEN_MASKS)
def test_the_varlen_backward_call_is_torchs_for_one_batch_row(mask):
    """The same with one batch row (packed THD batches always have one): a plan of several calls once passed each
    call's lse as a strided view of the whole ``[heads, rows]`` one, which torch's kernel reads as dense (other
    heads' rows: wrong gradients, silently). ``out`` and ``dout`` may be views of the whole block's in the same
    memory order (their strides are the kernel's parameters: ``_same_layout_view``); the lse may not."""
    found = varlen_differences(_block_mask(*mask), b=1)
    assert [d for d in found if not _same_layout_view(d)] == [], found


def _varlen_bwd_int64(self, dout, q, k, v, out, lse, cum_q, cum_k, call, b, scale):
    """The backward call with int64 cumulative lengths and without the window (two mistakes)."""
    rng_state, unused = K._unused_rng(q, torch.uint64, (2,))
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cum_q.long(), cum_k.long(), call.max_q, call.kernel_max_k, 0.0, call.causal,
        rng_state, unused, scale=scale)


def test_the_varlen_comparison_flags_a_wrong_call():
    """Not vacuous: int64 ``cum_seq_q/k`` (arguments 6, 7) and a missing window (15, 16) are reported."""
    found = varlen_differences(_block_mask(False, (0, 13, 40), (6, 3)), bwd=_varlen_bwd_int64)
    assert sorted({d[0] for d in found}) == [6, 7, 15, 16], found


def test_the_cuda_seam_asks_torchs_rule_about_mla_head_dims_alone(monkeypatch):
    """``CudaOps.takes_head_dims`` asks torch's own cuDNN rule with K/V in q's head count (views, no copy: the
    question is the head dims, GQA is asked per block), once per case, whether a backward follows included."""
    from megatron_ring.device import CudaOps

    asked = []

    def can_use(params, debug):
        asked.append((tuple(params.query.shape), tuple(params.key.shape), tuple(params.value.shape),
                      params.value.stride(1), params.query.requires_grad))
        return True

    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", can_use)
    ops = CudaOps()
    q, k, v = torch.randn(1, 8, 16, 192), torch.randn(1, 2, 16, 192), torch.randn(1, 2, 16, 128)
    assert all(ops.takes_head_dims("cudnn", q, k, v) for _ in range(3))
    assert ops.takes_head_dims("cudnn", q.requires_grad_(), k, v)
    assert asked == [((1, 8, 16, 192), (1, 8, 16, 192), (1, 8, 16, 128), 0, False),
                     ((1, 8, 16, 192), (1, 8, 16, 192), (1, 8, 16, 128), 0, True)]
    # the answers are kept per shape, which packed batches vary: bounded (cleared when full), still right
    monkeypatch.setattr(CudaOps, "CASES_KEPT", 2)
    for s in range(3, 40):
        assert ops.takes_head_dims("cudnn", q[:, :, :s], k[:, :, :s], v[:, :, :s]) and len(ops._gqa) <= 2


def test_autos_choices_per_mla_shape_are_bounded(monkeypatch):
    """``auto``'s choice with MLA head dims is kept per shape (torch's rule reads them): cleared when full."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(K, "_AUTO_KEPT", 3)
    K._auto_choice.clear()
    with device.use("cuda", FakeCuda(head_dims=True)), FakeTensorMode():
        for s in range(8, 40):
            q, k = torch.empty(1, 8, s, 192, device="cuda", dtype=torch.bfloat16), \
                torch.empty(1, 2, s, 192, device="cuda", dtype=torch.bfloat16)
            v = torch.empty(1, 2, s, 128, device="cuda", dtype=torch.bfloat16)
            assert K.select_kernel(q, "auto", 192, kv=(k, v)).name == "cudnn" and len(K._auto_choice) <= 3
    K._auto_choice.clear()


def test_the_cuda_seam_asks_torchs_dispatch_rule_once_per_case(monkeypatch):
    """``CudaOps.takes_gqa`` asks torch's own rule (``can_use_cudnn_attention`` / ``can_use_flash_attention``) with
    ``enable_gqa=True`` on the call's tensors, once per case (shapes, dtype, causal), not once per call; its answer
    is what the kernel does (here: no, then K/V are expanded)."""
    from megatron_ring.device import CudaOps

    asked = []

    def can_use(params, debug):
        asked.append((params.enable_gqa, params.is_causal, tuple(params.key.shape)))
        return len(asked) == 1  # yes to the first case, no to the second

    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", can_use)
    ops = CudaOps()
    q, k = torch.randn(1, 8, 16, 64), torch.randn(1, 2, 16, 64)
    assert [ops.takes_gqa("cudnn", q, k, k, True) for _ in range(3)] == [True] * 3
    assert not ops.takes_gqa("cudnn", q, k[:, :, :8], k[:, :, :8], True)
    assert asked == [(True, True, (1, 2, 16, 64)), (True, True, (1, 2, 8, 64))]


ENGINE_VARLEN_CASES = [dict(P=2, fmt="thd", layout="striped"), dict(P=4, fmt="thd", window=(40, 0)),
                       dict(P=2, fmt="thd", layout="striped", dims=(100, 100)),
                       dict(P=4, fmt="thd", dims=(128, 64), heads=(8, 2))]


def engine_varlen_calls(case: dict, seam: dict | None = None) -> tuple[list, set, set]:
    """Through ``ring_attention`` (fake CUDA, loopback ring, ``auto``): the differences of every
    ``_flash_attention_backward`` call of the masked tasks from torch's call for the same inputs, and the head
    dims and scales of those calls (``seam``: the fake device's answers)."""
    from tests.fake_cuda.test_fake_cuda import Case, _inputs, _plan_on_host, fake_backward
    from megatron_ring import ring_attention
    from megatron_ring.transport.ring import LoopbackRing

    c = Case(kernel="auto", **case)
    rank = c.P // 2
    _plan_on_host(c, rank)
    K._auto_choice.clear()  # auto's choice is cached per case; the fake device's answers differ per test
    seam, fake = _fake(**(seam or {}))
    with seam, fake:
        q, k, v, kw, leaves = _inputs(c)
        with BackwardRecorder("aten::_flash_attention_forward") as fwd:
            out = ring_attention(q, k, v, ring=LoopbackRing(c.P, rank, q.device), **kw)
        with BackwardRecorder(VARLEN_OP) as rec:
            fake_backward(out, torch.randn_like(out), leaves)
        assert rec.calls and len(rec.calls) == len(fwd.calls)  # the backward ring runs the forward's calls in order
        found = [d for f, call in zip(fwd.calls, rec.calls) for d in differing(_varlen_torch_call(f, call), call)]
        return (found, {_values(call)["query"].shape[-1] for call in rec.calls},
                {_values(call)["scale"] for call in rec.calls})


@pytest.mark.parametrize("mla_on_cudnn", [False, True])
@pytest.mark.parametrize("case", ENGINE_VARLEN_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_engine_calls_each_varlen_backward_as_torch_would(case, mla_on_cudnn):
    """On packed documents, every ``_flash_attention_backward`` call the ring makes equals torch's autograd call
    for the same inputs, up to ``out``/``dout`` views in the same memory order; head dims the kernel does not take
    arrive zero-padded, at the call's scale. ``mla_on_cudnn``: where cuDNN takes MLA head dims as they are (its
    dense tasks then run them so), the masked tasks' variable-length kernel still gets them padded."""
    found, dims, scales = engine_varlen_calls(case, dict(head_dims=mla_on_cudnn))
    assert [d for d in found if not _same_layout_view(d)] == [], found
    dqk, dv = case.get("dims", (64, 64))
    assert dims == {-(-max(dqk, dv) // 8) * 8} and len(scales) == 1, (dims, scales)
    assert scales.pop() == pytest.approx(dqk ** -0.5, rel=1e-12)  # the call's head dim's, not the padded one's


def test_the_engine_varlen_comparison_flags_a_wrong_call(monkeypatch):
    """Not vacuous: with the backward called with int64 cumulative lengths and without the window, the engine's
    calls differ from torch's in exactly those arguments."""
    from megatron_ring.kernels.varlen import VarlenFlashCudaKernel

    monkeypatch.setattr(VarlenFlashCudaKernel, "_bwd", _varlen_bwd_int64)
    found, _, _ = engine_varlen_calls(dict(P=4, fmt="thd", window=(40, 0)))
    assert sorted({d[0] for d in found if not _same_layout_view(d)}) == [6, 7, 15, 16], found


class _Event:
    """A stand-in for ``torch.cuda.Event``: records its ``record`` and ``wait`` calls in a shared log."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream=None):
        self.log.append(("record", self, stream.name))

    def wait(self, stream=None):
        self.log.append(("wait", self, stream.name))


class _Stream:
    """A stand-in for ``torch.cuda.Stream`` whose stream-to-stream methods are torch's own (they call only
    ``Event``, ``Event.record`` and ``Event.wait``)."""

    wait_stream = torch.cuda.Stream.wait_stream
    record_event = torch.cuda.Stream.record_event
    wait_event = torch.cuda.Stream.wait_event

    def __init__(self, name: str) -> None:
        self.name = name


def _waits(log: list) -> list:
    """The log with each event named by the call that recorded it last: a wait must name the record just before it
    on the same event (the dependency it makes is that record's state)."""
    last, out = {}, []
    for op, event, stream in log:
        if op == "record":
            last[event] = len(out)
            out.append((op, stream))
        else:
            out.append((op, stream, "waits on the record at", last.get(event)))
    return out


def test_the_cuda_seams_stream_wait_is_torchs_with_one_event_per_stream_and_thread(monkeypatch):
    """``CudaOps.wait_stream`` makes the dependency torch's ``Stream.wait_stream`` makes (a record on the waited
    stream, then the waiter waits on that record), call by call, but re-records one event per waited stream and
    thread instead of making one per call (4 driver calls per wait become 2); another thread gets its own event.
    Negative controls: a wait queued before its record, and a record by another thread between this thread's
    record and wait on a shared event, are differences the comparison reports."""
    import threading

    from megatron_ring.device import CudaOps

    theirs, ours = [], []
    compute, side = _Stream("compute"), _Stream("side")
    monkeypatch.setattr(torch.cuda.streams, "Event", lambda: _Event(theirs))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(ours))
    ops = CudaOps()
    for waiter, waited in [(side, compute), (compute, side)] * 3:
        waiter.wait_stream(waited)  # torch's own
        ops.wait_stream(waiter, waited)
    assert _waits(ours) == _waits(theirs) and len(ours) == 12
    assert len({e for _, e, _ in theirs}) == 6 and len({e for _, e, _ in ours}) == 2  # torch: one event per call

    mine = {e for _, e, _ in ours}
    thread = threading.Thread(target=ops.wait_stream, args=(side, compute))
    thread.start()
    thread.join()
    assert _waits(ours[12:]) == _waits(theirs[:2]) and ours[12][1] not in mine  # the thread's own event

    event = ours[0][1]
    assert _waits([("wait", event, "side"), ("record", event, "compute")]) != _waits(theirs[:2])
    assert _waits([("record", event, "compute"), ("record", event, "other thread's"), ("wait", event, "side")])[1:] \
        != _waits(theirs[:2])
