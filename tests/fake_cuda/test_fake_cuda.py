"""The fake-CUDA tier: the GPU path of the whole engine, traced without a GPU.

Inside ``torch._subclasses.fake_tensor.FakeTensorMode`` (a CUDA build of torch, running on CPU) tensors on
device ``cuda`` run the real ops' meta kernels: every shape, dtype, stride and device is checked as on a
GPU while nothing is computed. Anything that initialises CUDA fails here ("Found no NVIDIA driver"), so
this tier also proves that the engine asks the device only through its seam (``megatron_ring/device.py``):
the tests install :class:`fake_device.FakeCuda` for ``cuda`` (streams and events as Python objects, an
sm90 capability), and :class:`fake_device.StreamChecker` checks every op against the stream it runs on:
a tensor written on one stream and used on another must be waited for, and every tensor used on the
side stream must be ``record_stream``-ed there. A host read of a device value would raise in this mode
(a fake tensor has no value), so a traced call also proves the ring makes none.

How the backward runs: the autograd engine itself wants a CUDA device for fake CUDA tensors ("hasPrimaryContext
expects a valid device index"), so :func:`fake_backward` walks the graph by hand, as the engine would, with
grad mode off: every node once the nodes it feeds have run, torch's own nodes called (``node(*grads)``) and our
autograd Functions' ``apply`` (``RingAttentionFunction.backward(ctx, dout)``, the collective strategies'
Functions: our Python code), down to each leaf's ``AccumulateGrad``.
The gradients that reach the leaves are checked (shape, dtype, device, strides).

The cases (``CASES``): every torch-native CUDA kernel of ``kernels/block.py`` (``sdpa_cuda`` -- torch's
memory-efficient op, passed as an instance since it is refused by name --, ``flash_cuda``, ``cudnn``) and
``auto``, forward and backward, at P = 1, 2, 4 on the loopback transport; causal and not; zigzag / striped / contiguous; BSHD / SBHD / THD with documents; GQA
and MQA; MLA head dims; windows; sinks; dropout; bf16 and fp16; as-is / bf16 / fp8 / fp16 wire;
``kv_pieces`` and ``head_chunks``; and at P = 1 every comm type (a loopback runs only ``p2p`` at P > 1).
``flash_attn`` and TransformerEngine cannot be installed here: their call signatures are checked against
the libraries' sources in ``test_library_signatures.py``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.fake_device import FakeCuda, StreamChecker
from megatron_ring import device, ring_attention
from megatron_ring.kernels import block as K
from megatron_ring.kernels import varlen as V
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring.transport.streams import SideStream

pytestmark = pytest.mark.fake_cuda

S_LOCAL = 64  # tokens per rank (nothing is computed: the size only has to be valid for every layout)


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str = "flash_cuda"
    P: int = 2
    causal: bool = True
    layout: str = "zigzag"
    fmt: str = "bshd"
    heads: tuple[int, int] = (4, 2)
    dims: tuple[int, int] = (64, 64)  # (d_qk, d_v)
    dtype: torch.dtype = torch.bfloat16
    wire: str | None = None
    kv_pieces: int | None = None
    head_chunks: int = 1
    window: tuple[int, int] | None = None
    sink: str | None = None  # None, "float", "tensor"
    dropout: float = 0.0
    comm_type: str = "p2p"
    s_local: int = S_LOCAL  # tokens per rank

    @property
    def id(self) -> str:
        base = Case()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name) and f.name != "kernel"]
        return "-".join([self.kernel, *diff]).replace("torch.", "").replace(" ", "")


NATIVE = ("sdpa_cuda", "flash_cuda", "cudnn")


def _cases() -> list[Case]:
    out: list[Case] = []
    for kernel in (*NATIVE, "auto"):  # the core: every kernel x P x causal
        for P in (1, 2, 4):
            for causal in (True, False):
                out.append(Case(kernel=kernel, P=P, causal=causal))
    for kernel in NATIVE:
        out += [Case(kernel=kernel, P=4, layout=lay) for lay in ("striped", "contiguous")]
        out += [Case(kernel=kernel, P=4, fmt="sbhd", causal=False),
                Case(kernel=kernel, P=4, fmt="thd"),  # with documents (cu_seqlens)
                Case(kernel=kernel, P=2, fmt="thd", causal=False),
                Case(kernel=kernel, P=4, heads=(8, 2)),  # GQA
                Case(kernel=kernel, P=2, heads=(4, 1), causal=False),  # MQA
                Case(kernel=kernel, P=4, window=(40, 0)),
                Case(kernel=kernel, P=2, causal=False, window=(64, 64), layout="contiguous"),
                Case(kernel=kernel, P=2, sink="float"),
                Case(kernel=kernel, P=4, sink="tensor", causal=False),
                Case(kernel=kernel, P=2, dtype=torch.float16),
                Case(kernel=kernel, P=4, dtype=torch.float16, causal=False, layout="striped"),
                Case(kernel=kernel, P=4, heads=(8, 4), kv_pieces=2),
                Case(kernel=kernel, P=2, heads=(8, 4), head_chunks=2),
                Case(kernel=kernel, P=4, heads=(8, 4), kv_pieces=2, head_chunks=2, wire="fp8")]
        out += [Case(kernel=kernel, P=P, wire=w) for P in (2, 4) for w in ("bf16", "fp8")]
        out.append(Case(kernel=kernel, P=2, wire="fp16", dtype=torch.bfloat16, causal=False))
    # MLA head dims (d_qk 192 > cuDNN's 128: auto falls back to flash_cuda); cuDNN with d_qk 128, d_v 64
    out += [Case(kernel=k, P=2, dims=(192, 128)) for k in ("sdpa_cuda", "flash_cuda", "auto")]
    out.append(Case(kernel="cudnn", P=2, dims=(128, 64)))
    # head dims that are not a multiple of 8 (zero-padded to one, kernels/head_dim.py): 1 (every gradient has a
    # size-1 last dim), 100 with MQA
    out += [Case(kernel="auto", P=2, dims=(1, 1)), Case(kernel="cudnn", P=4, dims=(100, 100), heads=(4, 1))]
    # masked tasks on the variable-length flash kernel: MLA head dims (padded), GQA striped, documents + window
    out += [Case(kernel="auto", P=2, fmt="thd", dims=(192, 128)),
            Case(kernel="flash_cuda", P=4, fmt="thd", heads=(8, 2), layout="striped"),
            Case(kernel="cudnn", P=2, fmt="thd", causal=False, window=(10, 3), layout="contiguous"),
            Case(kernel="cudnn", P=1, fmt="thd", heads=(4, 1))]
    # dropout runs its own kernels (on CUDA the fused ones, kernels/dropout_triton.py): dense, documents with a
    # window (masked tiles), MLA head dims
    out += [Case(kernel="auto", P=P, dropout=0.1) for P in (1, 4)]
    out += [Case(kernel="auto", P=2, dropout=0.1, fmt="thd", window=(10, 3)),
            Case(kernel="auto", P=2, dropout=0.1, dims=(192, 128), heads=(8, 2))]
    out += [Case(kernel="auto", P=1, comm_type=c) for c in ("all_gather", "a2a", "a2a+p2p", "auto")]
    return out


CASES = _cases()


def _expected_kernel(case: Case) -> str | None:
    """The CUDA kernel class the case must reach (None: dropout, whose own kernel runs every task)."""
    if case.dropout:
        return None
    if case.kernel != "auto":
        return case.kernel
    return "cudnn" if case.dims[0] <= 128 else "flash_cuda"  # flash_attn, te_fused: not installed here


_KERNEL_CLASSES = {"sdpa_cuda": K.CudaSDPAKernel, "flash_cuda": K.TorchFlashCudaKernel, "cudnn": K.CudnnKernel}


def fake_backward(out: torch.Tensor, dout: torch.Tensor, leaves: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The backward of ``out`` by hand (see the module doc); returns ``{id(leaf): gradient reaching it}``.

    The autograd engine's walk, in Python: every node of the graph runs once all the nodes it feeds have run
    (Kahn's order), its output gradients summed per edge (a missing one is zeros, as the engine materialises
    them). A C++ node's results line up with its ``next_functions``; a custom Function's backward returns one
    result per forward argument, and its edges are its tensor arguments: those that need a gradient are the
    edges with a node, in order (``needs_input_grad``)."""
    def edges(node):
        return [(fn, nr) for fn, nr in node.next_functions if fn is not None]

    waiting: dict = {}
    stack, seen = [out.grad_fn], {out.grad_fn}
    while stack:  # how many edges reach each node
        for fn, _ in edges(stack.pop()):
            waiting[fn] = waiting.get(fn, 0) + 1
            if fn not in seen:
                seen.add(fn)
                stack.append(fn)
    incoming: dict = {out.grad_fn: {0: dout}}
    ready, grads = [out.grad_fn], {}
    with torch.no_grad():
        while ready:
            node = ready.pop()
            got = incoming.pop(node, {})
            if type(node).__name__ == "AccumulateGrad":
                grads[id(node.variable)] = got[0]
                continue
            meta = node._input_metadata
            g = [got[i] if i in got else torch.zeros(meta[i].shape, dtype=meta[i].dtype, device=meta[i].device)
                 for i in range(len(meta))]
            if hasattr(node, "_forward_cls"):  # a custom Function: its backward, our Python code
                results = node.apply(*g)
                results = results if isinstance(results, tuple) else (results,)
                results = [r for r, needed in zip(results, node.needs_input_grad) if needed]
                targets = [(fn, nr) for fn, nr in node.next_functions if fn is not None]
            else:
                results = node(*g)
                results = results if isinstance(results, tuple) else (results,)
                targets = list(node.next_functions)
            for (fn, nr), grad in zip(targets, results):
                if fn is None:
                    continue
                if grad is not None:
                    slot = incoming.setdefault(fn, {})
                    slot[nr] = grad if nr not in slot else slot[nr] + grad
                waiting[fn] -= 1
                if not waiting[fn]:
                    ready.append(fn)
    assert set(grads) == {id(t) for t in leaves}, "a leaf got no gradient"
    return grads


def _kernel_arg(name: str):
    """``sdpa_cuda`` is refused by name until verified on a GPU: its cases pass an instance (traced all the same)."""
    return K.CudaSDPAKernel() if name == "sdpa_cuda" else name


def _documents(case: Case) -> list[int] | None:
    """The global documents of a THD case (boundaries inside blocks, padding at the end); ``layout="doc-zigzag"``:
    Megatron's per-document zigzag, documents padded to multiples of 2P, each filler a document of its own."""
    if case.fmt != "thd":
        return None
    total, c = case.s_local * case.P, 2 * case.P
    if case.layout == "doc-zigzag":
        return [0, 2 * c - 3, 2 * c, 5 * c, total - 5, total]
    return [0, 37, total // 2 + 5, total - 9]


def _layout_of(case: Case):
    """The case's layout: a name, or for ``"doc-zigzag"`` the :class:`~megatron_ring.DocumentZigzag` of the padded
    documents' slots (:func:`_documents`)."""
    if case.layout != "doc-zigzag":
        return case.layout
    from megatron_ring import DocumentZigzag

    c = 2 * case.P
    return DocumentZigzag([0, 2 * c, 5 * c, case.s_local * case.P])


def _inputs(case: Case):
    b = 1 if case.fmt == "thd" else 2
    h, hk = case.heads
    dqk, dv = case.dims
    s = case.s_local

    def make(heads, d):
        shape = {"bshd": (b, s, heads, d), "sbhd": (s, b, heads, d), "thd": (s, heads, d)}[case.fmt]
        return torch.randn(shape, device="cuda", dtype=case.dtype, requires_grad=True)

    q, k, v = make(h, dqk), make(hk, dqk), make(hk, dv)
    kw = dict(causal=case.causal, layout=_layout_of(case), qkv_format=case.fmt, comm_dtype=case.wire,
              kernel=_kernel_arg(case.kernel), kv_pieces=case.kv_pieces, head_chunks=case.head_chunks, window=case.window,
              comm_type=case.comm_type)
    leaves = [q, k, v]
    if case.fmt == "thd":  # documents over the global stream, boundaries inside blocks
        # host boundaries (a list): a CUDA tensor would cost one device-to-host read per call (the schedule is
        # planned on the host from them), which FakeTensorMode refuses
        kw["cu_seqlens"] = _documents(case)  # as in _plan_on_host
    if case.sink == "float":
        kw["softmax_offset"] = 0.0
    elif case.sink == "tensor":
        kw["softmax_offset"] = torch.zeros(h, device="cuda", requires_grad=True)
        leaves.append(kw["softmax_offset"])
    if case.dropout:
        # P > 1: the seed as a CUDA tensor (as the Megatron glue draws it): FakeTensorMode refuses any host
        # read of it, so the case also checks that the seed stays on the device
        seed = torch.tensor(1234, device="cuda") if case.P > 1 else 1234
        kw.update(dropout_p=case.dropout, dropout_seed=seed)
    return q, k, v, kw, leaves


@pytest.fixture
def kernel_calls(monkeypatch):
    """Forward and backward calls per CUDA kernel class; ``varlen_cuda``: the variable-length flash kernel
    (masked tasks), ``math``: the math kernel's calls (on CUDA a masked task that fell back)."""
    calls: dict[str, list[int]] = {n: [0, 0] for n in (*_KERNEL_CLASSES, "varlen_cuda", "math")}
    for name, cls, f_name, b_name in (("varlen_cuda", V.VarlenFlashCudaKernel, "_fwd", "_bwd"),
                                      ("math", K.MathKernel, "forward", "backward")):
        fwd, bwd = getattr(cls, f_name), getattr(cls, b_name)
        monkeypatch.setattr(cls, f_name, lambda self, *a, _f=fwd, _n=name, **kw: (
            calls[_n].__setitem__(0, calls[_n][0] + 1), _f(self, *a, **kw))[1])
        monkeypatch.setattr(cls, b_name, lambda self, *a, _b=bwd, _n=name, **kw: (
            calls[_n].__setitem__(1, calls[_n][1] + 1), _b(self, *a, **kw))[1])
    for name, cls in _KERNEL_CLASSES.items():
        fwd, bwd = cls._fwd, cls._bwd

        def spy_f(self, *a, _f=fwd, _n=name):
            calls[_n][0] += 1
            return _f(self, *a)

        def spy_b(self, *a, _b=bwd, _n=name):
            calls[_n][1] += 1
            return _b(self, *a)

        monkeypatch.setattr(cls, "_fwd", spy_f)
        monkeypatch.setattr(cls, "_bwd", spy_b)
    return calls


def _task_kinds(case: Case, rank: int) -> set[str]:
    """The kinds of task rank ``rank`` computes in ``case`` ("dense": any kind but masked; "masked": documents,
    unaligned window edges, which run on the variable-length flash kernel), in the schedule the engine uses:
    tiles where the masked tasks fall back to the math kernel (fp32), whole blocks with dropout (its fused
    kernels), else whole blocks, each one task where the variable-length kernel takes it."""
    kinds = _plan_on_host(case, rank)
    return kinds["tiles"] if case.dtype == torch.float32 else kinds["whole"] if case.dropout else kinds["one"]


def _plan_on_host(case: Case, rank: int) -> dict[str, set[str]]:
    """Build the masked schedules (documents, windows) with real host tensors first: the engine plans on
    the host from CPU index tensors (cached per signature), which FakeTensorMode would make fake. Returns
    the kinds of task the rank has in each schedule (:func:`_task_kinds`)."""
    from megatron_ring.call import attention_mask as _attention_mask
    from megatron_ring.kernels.dropout import FusedDropoutKernel
    from megatron_ring.kernels.varlen_plan import one_task, plan_for
    from megatron_ring.schedules.layouts import TaskKind
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.schedules.masks import needed_steps, schedule

    s = case.s_local
    total = s * case.P
    rule = _attention_mask(case.causal, _documents(case), case.window, total)
    variants = {"tiles": (None, None), "whole": (s, FusedDropoutKernel.one_task), "one": (s, one_task)}
    kinds = {name: {"dense"} for name in variants}
    if not rule.plain:
        kinds = {name: set() for name in variants}
        lay = get_layout(_layout_of(case))
        needed_steps(lay, rule, case.P, s)
        for t in range(case.P):
            # tiles (math kernel, dropout), whole blocks on the fused dropout kernels (any block one task) and whole
            # blocks as one task where the variable-length kernel takes it (varlen.whole_blocks: without dropout)
            for name, (tile, one) in variants.items():
                for task in schedule(lay, rule, case.P, rank, (rank - t) % case.P, s, tile, one):
                    if task.kind is TaskKind.MASKED:
                        plan_for(task.mask)  # the masked task's segment plan (kernels/varlen_plan.py), host work
                    kinds[name].add("masked" if task.kind is TaskKind.MASKED else "dense")
    return kinds


def run_case(case: Case, rank: int | None = None, dev: FakeCuda | None = None):
    """Trace one forward and backward of ``case`` on fake CUDA; returns (q, out, grads, checker, dev)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = dev or FakeCuda()
    rank = case.P // 2 if rank is None else rank  # not rank 0: every kind of step (src <, ==, > rank)
    _plan_on_host(case, rank)
    # allow_non_fake_inputs: the host plan's real CPU tensors (positions) meet fake device tensors, as host
    # tensors meet CUDA ones on a GPU
    with device.use("cuda", dev), FakeTensorMode(allow_non_fake_inputs=True), StreamChecker(dev) as checker:
        q, k, v, kw, leaves = _inputs(case)
        out = ring_attention(q, k, v, ring=LoopbackRing(case.P, rank, q.device), **kw)
        grads = fake_backward(out, torch.randn_like(out), leaves)
    assert not torch.cuda.is_initialized()  # every device question went through the seam
    return leaves, out, grads, checker, dev


def strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides over its dims of size over 1 (a size-1 dim's stride says nothing of the memory order)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n != 1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_and_backward_on_fake_cuda(case, kernel_calls):
    leaves, out, grads, checker, dev = run_case(case)
    q, v = leaves[0], leaves[2]
    # the output: q's layout with v's head dim, q's dtype, on the GPU, contiguous in the caller's format
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    assert out.dtype == q.dtype and out.device.type == "cuda" and out.is_contiguous()
    for leaf in leaves:  # each gradient: its input's shape, dtype, device and strides (of the dims over size 1)
        g = grads[id(leaf)]
        assert (g.shape, g.dtype, g.device, strides(g)) == (leaf.shape, leaf.dtype, leaf.device, strides(leaf))
    # the CUDA kernel asked for (or auto's choice) ran, forward and backward
    want = _expected_kernel(case)
    kinds = _task_kinds(case, case.P // 2)
    if want is not None and "dense" in kinds:  # (with documents every tile may be masked: then it never runs)
        assert kernel_calls[want][0] > 0 and kernel_calls[want][1] > 0, kernel_calls
    varlen = "varlen_cuda" if want is not None and "masked" in kinds else None
    if varlen:  # masked tasks reach the fused variable-length kernel, never the math kernel
        assert kernel_calls[varlen][0] > 0 and kernel_calls[varlen][1] > 0, kernel_calls
    assert all(c == [0, 0] for n, c in kernel_calls.items() if n not in (want, varlen)), kernel_calls
    # streams: every consumer waits, every tensor used on the side stream is recorded there
    assert checker.problems == [], checker.problems[:5]
    assert checker.unrecorded() == [], checker.unrecorded()[:5]
    if case.P > 1:
        assert checker.ops_on.get("side1", 0) > 0 and dev.log["record_stream"] > 0 and dev.log["wait_stream"] > 0
        assert dev.log["to_host"] == 1  # the status, copied once per forward ring (K/V pieces share it)
    else:
        assert dev.log["new_stream"] == 0  # one rank: no exchange, no side stream


def test_the_stream_checker_catches_a_missing_wait(monkeypatch):
    """Not vacuous: without the join (the compute stream's wait for the exchange) the checker objects."""
    monkeypatch.setattr(SideStream, "join", lambda self: None)
    *_, checker, _ = run_case(Case(P=2))
    assert any("without waiting" in p for p in checker.problems)


def test_the_stream_checker_catches_a_missing_record_stream(monkeypatch):
    monkeypatch.setattr(FakeCuda, "record_stream", lambda self, t, s: None)
    *_, checker, _ = run_case(Case(P=2))
    assert checker.unrecorded()


def test_auto_never_picks_a_kernel_whose_library_is_missing(monkeypatch):
    """flash_attn and TransformerEngine are not installed here: auto skips them (cuDNN first; without cuDNN,
    torch's flash kernel), and forcing them is refused with a message naming the fix."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import importlib.util
    assert importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("transformer_engine") is None
    with device.use("cuda", FakeCuda()), FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
        K._auto_choice.clear()
        assert K.select_kernel(q).name == "cudnn"
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
        K._auto_choice.clear()
        assert K.select_kernel(q).name == "flash_cuda"
        for name in ("flash_attn", "te_fused"):
            assert not K.KERNELS[name]().supports(q)
            with pytest.raises(ValueError, match="kernel='auto'"):
                K.select_kernel(q, name)
    K._auto_choice.clear()


def test_architecture_comes_from_the_seam():
    """Fused kernels ask the device seam for the architecture: sm75 gets only the memory-efficient op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda(capability=(7, 5))), FakeTensorMode():
        q = torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.float16)
        assert [n for n in ("sdpa_cuda", "flash_cuda", "cudnn") if K.KERNELS[n]().supports(q)] == ["sdpa_cuda"]


def test_nothing_touches_cuda_at_import_or_construction():
    """Building a ring, a side stream and a kernel for a CUDA device makes no CUDA call (no fake installed:
    any call would fail here, there is no driver)."""
    from megatron_ring.transport.streams import side_stream_for

    side = side_stream_for(torch.device("cuda", 1))  # a device no other test used
    ring = LoopbackRing(2, 0, torch.device("cuda", 1))
    for name in K.KERNELS:
        K.KERNELS[name]()
    assert side._made is None and ring.stream._made is None and not torch.cuda.is_initialized()


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "negative-control-no-autocast"])
def test_fp32_inputs_under_autocast_run_a_bf16_kernel(autocast, kernel_calls):
    """Under ``torch.autocast("cuda", dtype=torch.bfloat16)`` fp32 q, k, v go to bf16 (as for torch's SDPA;
    core/autocast.py): ``auto`` runs cuDNN on them, forward and backward (the backward walked with autocast still on,
    as autograd's thread-local state carries it to the device thread), not the fp32 ``math`` kernel; the output is
    bf16, the gradients fp32. Negative control: the same call without autocast runs ``math`` and stays fp32.
    (``torch.autocast("cuda")`` turns itself off without a GPU: the state is set directly.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = Case(kernel="auto", P=2, dtype=torch.float32)
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", autocast)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        with device.use("cuda", FakeCuda()), FakeTensorMode(allow_non_fake_inputs=True):
            q, k, v, kw, leaves = _inputs(case)
            out = ring_attention(q, k, v, ring=LoopbackRing(case.P, 1, q.device), **kw)
            grads = fake_backward(out, torch.randn_like(out), leaves)
    finally:
        torch.set_autocast_enabled("cuda", was[0])
        torch.set_autocast_dtype("cuda", was[1])
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert all(grads[id(t)].dtype == torch.float32 for t in leaves)
    used = {n for n, (f, b) in kernel_calls.items() if f and b}
    assert used == ({"cudnn"} if autocast else {"math"}), kernel_calls
