"""GPU benchmark row: the ring schedule's compute on one GPU vs one-GPU attention on the same problem.

Every rank's schedule (P = 2, 4, 8...) runs through :class:`~megatron_ring.transport.ring.LoopbackRing` on the one
GPU, one rank after another; the row reports the slowest rank's forward+backward time x P (what P GPUs
would spend in total) against one-GPU attention on the whole sequence: the efficiency the engine leaves on
the table (block splitting, merges, kernel choice, host time). No communication is timed.

A row (:func:`gpu_row`) reports, besides the efficiency:

* ``host_ms``: host time of the slowest rank's call (forward+backward launched, not waited for): where it
  approaches ``ring_slowest_rank_ms`` the call is host-bound;
* ``launches``: CUDA kernels one call of that rank launches (torch profiler, one call);
* ``kernel_ms_<kind>``: the GPU time of that call's kernels by kind (:func:`kernel_kind`: ``attention``,
  ``merge``, ``lists`` (the list op), ``copies``, ``other``; same profiler pass), and
  ``reference_kernel_ms_attention``, the one-GPU reference's attention kernels: where the ring's attention
  kernels x P exceed the reference's, the gap is in the kernels on shorter blocks, else in the rest;
* where the slowest rank's host time goes: ``host_ms_forward``, ``host_ms_backward`` (no profiler; each part
  launched and not waited for, medians), and under ``cProfile`` (:func:`host_split`) ``host_ms_attention_ops``
  (their host work, cuDNN's included), ``host_ms_other_ops`` (every other torch op, autograd's engine),
  ``host_ms_triton`` (Triton's launches), ``host_ms_ours`` (this library's Python), ``host_ms_python`` (the rest)
  and ``host_ops`` (torch ops called from Python per call);
* ``host_ms_new_documents`` (packed rows): host time of the slowest rank's call on a NEW document mix each call
  (launched, not waited for): the first layer of every micro-batch, which plans its ring afresh (the planning alone:
  ``--plan-time``, :mod:`megatron_ring_lab.bench.plan_time`);
* ``peak_gib``: peak GPU memory of one call above what the inputs hold;
* ``graphed_*`` (``graphed=True``): the same call captured once into a CUDA graph and replayed (forward and
  backward, ``torch.autograd.grad``), its time and efficiency; a capture that fails is reported, not raised;
* packed documents (``docs=True``): ONE packed THD stream of ``seq`` tokens cut into a real document-length mix
  (:func:`packed_lengths`: web-like, documents at most a quarter of the stream), the ``striped`` layout by
  default, or ``layout="doc-zigzag"``: Megatron's per-document zigzag (``--sft``: documents padded to multiples of
  2P, :class:`~megatron_ring.DocumentZigzag`), against one-GPU variable-length flash on the same packed stream
  (``aten._flash_attention_forward`` with ``cum_seq_q/k``; a per-document loop of SDPA where that op is
  missing, named in ``reference``).

``device="cpu"`` runs the same row on CPU (host clock; no launches, memory or graphs): how the lab's tests
check it without a GPU. Every field ran on an H200 on 2026-11-27 (docs/performance.md has the table), except the
kernel breakdown by kind, the host split and
``host_ms_new_documents``, added after that run.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from megatron_ring.api import ring_attention
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring_lab.bench.plan_time import packed_documents, packed_lengths

__all__ = ["gpu_row", "packed_lengths", "kernel_kind", "KERNEL_KINDS", "host_split", "host_kind", "HOST_KINDS"]


def _timer(dev: torch.device) -> Callable[[Callable[[], Any], int], tuple[float, float]]:
    """``time(fn, iters)`` -> (median ms of the work, median ms of host time per call)."""
    def time_it(fn, iters):
        fn()  # warm-up
        work, host = [], []
        for _ in range(iters):
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(dev)
                start.record()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
                end.record()
                end.synchronize()
                work.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                work.append((time.perf_counter() - t0) * 1e3)
                host.append(work[-1])
        return statistics.median(work), statistics.median(host)
    return time_it


#: kinds of CUDA kernels in a row's breakdown, in order
KERNEL_KINDS = ("attention", "merge", "lists", "copies", "other")


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name: an attention kernel (flash, cuDNN, memory-efficient, SDPA),
    the fused merge (``_merge_kernel``), the list op (``foreach_kernel``), a copy or fill (torch's copy and
    fill kernels, memcpy / memset), or other."""
    low = name.lower()
    if "merge_kernel" in low:
        return "merge"
    if "foreach_kernel" in low:
        return "lists"
    if any(w in low for w in ("flash", "fmha", "cudnn", "attention", "sdpa", "cutlass_sm")):
        return "attention"
    if any(w in low for w in ("memcpy", "memset", "copy", "fill")):
        return "copies"
    return "other"


def _profile(fn) -> tuple[int, dict[str, float]]:
    """CUDA kernels one call of ``fn`` launches (torch profiler), and their GPU ms by :func:`kernel_kind`."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ms = dict.fromkeys(KERNEL_KINDS, 0.0)
    for e in kernels:
        ms[kernel_kind(e.name)] += e.time_range.elapsed_us() / 1e3
    return len(kernels), ms


def _host_parts(call: Callable[[], torch.Tensor], dev: torch.device, iters: int) -> tuple[float, float]:
    """Median host ms of ``call()`` (the forward) and of its ``.sum().backward()``, each launched and not waited
    for (the device drained before each part: what the host spends, not what it waits for in a full queue)."""
    fwd, bwd = [], []
    for _ in range(iters):
        _drain(dev)
        t0 = time.perf_counter()
        out = call()
        fwd.append((time.perf_counter() - t0) * 1e3)
        loss = out.sum()
        _drain(dev)
        t0 = time.perf_counter()
        loss.backward()
        bwd.append((time.perf_counter() - t0) * 1e3)
    _drain(dev)
    return statistics.median(fwd), statistics.median(bwd)


def _host_new_documents(call: Callable[..., torch.Tensor], dev: torch.device, documents: Callable[[int], dict],
                        iters: int) -> float:
    """Median host ms of a forward+backward on a NEW document mix each call (``documents(seed)``: the call's
    keywords; launched, not waited for): what the first layer of every micro-batch pays on a packed batch, its
    planning included (the row's other times reuse one mix's plan)."""
    ms = []
    for i in range(iters):
        kw = documents(1 + i)
        _drain(dev)
        t0 = time.perf_counter()
        call(kw=kw).sum().backward()
        ms.append((time.perf_counter() - t0) * 1e3)
    _drain(dev)
    return statistics.median(ms)


def _documents(layout: str, world: int, seq: int, seed: int) -> tuple[dict, list[int]]:
    """A packed row's ``ring_attention`` keywords for the mix of ``seed`` (:func:`packed_lengths`), and its
    documents (``cu_seqlens``). ``layout="doc-zigzag"``: Megatron's per-document zigzag (``--sft``): each document
    padded to a multiple of 2P, its filler a document of its own (as the Megatron glue makes them), the layout the
    :class:`~megatron_ring.DocumentZigzag` of the padded slots."""
    cu, lay = packed_documents(layout, packed_lengths(seq, seed), world, seq)
    return dict(qkv_format="thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32), layout=lay), list(cu)


def _drain(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


#: where a call's host time goes, in :func:`host_split` (``host_ms_<kind>``)
HOST_KINDS = ("attention_ops", "other_ops", "triton", "ours", "python")


def host_split(fn: Callable[[], Any], dev: torch.device, calls: int = 3) -> dict[str, float | int]:
    """Host ms per call of ``fn`` by where it goes, under ``cProfile`` with autograd's backward on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``: on CUDA it runs on a device thread cProfile does not
    see), each function's own time summed by :func:`host_kind`: the attention ops (their host work: argument
    checks, cuDNN's graph look-up, the launch), every other torch op called from Python (and autograd's C++ engine
    with the ops it runs itself), Triton's launches (its Python and its launcher), this library's Python, and the
    rest of the Python; ``host_ops``: torch ops called from Python per call. cProfile adds a cost to every Python
    call, so the Python parts read high: compare calls measured the same way."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    with torch.autograd.set_multithreading_enabled(False):
        fn()  # warm (a first call under the setting)
        _drain(dev)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        _drain(dev)
    split = dict.fromkeys(HOST_KINDS, 0.0)
    ops = 0
    for (file, _, name), (_, ncalls, own, _, callers) in pstats.Stats(prof).stats.items():
        kind = host_kind(file, name, [c[0] for c in callers])
        split[kind] += own * 1e3 / calls
        ops += ncalls if kind in ("attention_ops", "other_ops") else 0
    return {**{f"host_ms_{k}": v for k, v in split.items()}, "host_ops": round(ops / calls)}


def _of_triton(file: str) -> bool:
    """Whether ``file`` is in Triton's package (a folder ``triton``), not one of this library's files that launch
    Triton kernels (``merge_triton.py``, ``triton_launch.py``: this library's Python)."""
    return "triton" in file.replace("\\", "/").split("/")[:-1]


def host_kind(file: str, name: str, caller_files: list[str] = ()) -> str:
    """The kind of a ``cProfile`` entry (:data:`HOST_KINDS`): a function of Triton's, or a built-in Triton's code
    calls (its launcher); an attention op; another torch op or method (``torch._ops``, a tensor method, a torch
    built-in, autograd's engine); this library's Python; anything else."""
    if _of_triton(file) or (file == "~" and caller_files and all(_of_triton(c) for c in caller_files)):
        return "triton"
    if file == "~":
        if "torch" in name or "Tensor" in name or "_EngineBase" in name:
            return "attention_ops" if "attention" in name else "other_ops"
        return "python"
    return "ours" if "megatron_ring" in file and "megatron_ring_lab" not in file else "python"


def _peak_gib(fn, dev: torch.device) -> float:
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**30


def _graphed(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor], dout: torch.Tensor):
    """``call``'s forward and backward captured into one CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (lazy init, caches)
        for _ in range(3):
            torch.autograd.grad(call(), leaves, dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(call(), leaves, dout)
    return graph.replay, grads


def _one_device_reference(q, k, v, causal: bool, cu: list[int] | None):
    """One-device attention forward+backward on the whole stream (BSHD ``[1, S, h, d]``): SDPA, or for packed
    documents variable-length flash on CUDA (a per-document SDPA loop elsewhere). Returns (fn, name)."""
    if cu is None:
        def sdpa():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, enable_gqa=True)
            out.sum().backward()
        return sdpa, "sdpa"
    qt, kt, vt = (x[0].detach().requires_grad_() for x in (q, k, v))  # [T, h, d]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if q.device.type == "cuda":
        def varlen():
            out = torch.ops.aten._flash_attention_forward(qt, kt, vt, cu_t, cu_t, longest, longest, 0.0, causal,
                                                          False)[0]
            out.sum().backward()
        return varlen, "varlen flash"
    g = q.shape[2] // k.shape[2]

    def per_document():
        outs = []
        for a, b in zip(cu, cu[1:]):
            outs.append(F.scaled_dot_product_attention(
                qt[a:b].transpose(0, 1), kt[a:b].repeat_interleave(g, 1).transpose(0, 1),
                vt[a:b].repeat_interleave(g, 1).transpose(0, 1), is_causal=causal))
        torch.cat(outs, dim=1).sum().backward()
    return per_document, "per-document sdpa"


def gpu_row(world: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            layout: str | None = None, causal: bool = True, iters: int = 10, kernel: str = "auto",
            docs: bool = False, graphed: bool = False, device: str = "cuda",
            v_head_dim: int | None = None) -> dict[str, Any]:
    """One benchmark row (see the module doc). ``seq``: tokens in all (``seq / world`` per rank). ``v_head_dim``:
    V's head dim where it differs from Q/K's (multi-latent attention; dense rows only: the packed rows' reference,
    variable-length flash, takes one head dim)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU benchmark row needs CUDA (device='cpu' runs it on CPU)")
    dv = head_dim if v_head_dim is None else v_head_dim
    if docs and dv != head_dim:
        raise ValueError("a packed row with MLA head dims has no one-GPU reference (variable-length flash takes one "
                         "head dim): drop --v-head-dim or --gpu-docs")
    layout = layout or ("striped" if docs else "zigzag")
    if layout == "doc-zigzag" and not docs:
        raise ValueError("the per-document zigzag (doc-zigzag) is a layout of packed documents: add --gpu-docs")
    docs_kw, cu = _documents(layout, world, seq, 0) if docs else (dict(layout=layout), None)
    q = torch.randn(1, seq, heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seq, kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, seq, kv_heads, dv, device=dev, dtype=dtype, requires_grad=True)
    lay = get_layout(docs_kw["layout"])
    time_it = _timer(dev)
    per_rank = []  # (work ms, host ms, rank, its call, leaves)
    for r in range(world):
        pos = lay.positions(seq, world, r).to(dev)
        leaves = [(t[0, pos] if docs else t[:, pos]).detach().clone().requires_grad_() for t in (q, k, v)]
        ring = LoopbackRing(world, r, dev)
        def call(leaves=leaves, ring=ring, kw=docs_kw):
            return ring_attention(*leaves, causal=causal, ring=ring, kernel=kernel, **kw)

        def step(call=call):
            call().sum().backward()

        work, host = time_it(step, iters)
        per_rank.append((work, host, r, call, leaves))
    reference, ref_name = _one_device_reference(q, k, v, causal, cu)
    one, _ = time_it(reference, iters)
    work, host, slow_rank, call, leaves = max(per_rank, key=lambda x: x[0])
    row = {"P": world, "seq": seq, "tokens_per_rank": seq // world, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "v_head_dim": dv, "dtype": str(dtype).removeprefix("torch."), "layout": layout,
           "causal": causal,
           "docs": len(cu) - 1 if cu else 0, "reference": ref_name,
           "ring_slowest_rank_ms": work, "ring_total_ms": work * world, "one_device_ms": one,
           "efficiency": one / (work * world), "host_ms": host, "launches": None, "peak_gib": None}

    def step():
        call().sum().backward()

    row["host_ms_forward"], row["host_ms_backward"] = _host_parts(call, dev, iters)
    if docs:
        row["host_ms_new_documents"] = _host_new_documents(
            call, dev, lambda seed: _documents(layout, world, seq, seed)[0], iters)
    try:
        row.update(host_split(step, dev))
    except Exception as exc:  # noqa: BLE001 - a diagnostic that fails is reported, the row's figures kept
        row["host_split_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if dev.type != "cuda":
        return row

    row["launches"], kinds = _profile(step)
    row.update({f"kernel_ms_{k}": v for k, v in kinds.items()})
    row["reference_kernel_ms_attention"] = _profile(reference)[1]["attention"]
    row["peak_gib"] = _peak_gib(step, dev)
    if graphed:
        try:
            replay, _ = _graphed(call, leaves, torch.randn_like(call()))
            g_ms, g_host = time_it(replay, iters)
            row.update(graphed_ms=g_ms, graphed_host_ms=g_host, graphed_efficiency=one / (g_ms * world))
        except Exception as exc:  # noqa: BLE001 - a capture that fails is a finding of the row
            row.update(graphed_ms=None, graphed_efficiency=None, graphed_error=f"{type(exc).__name__}: {exc}"[:300])
    return row
