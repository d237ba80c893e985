"""The device seam: everything the library asks of a device beyond tensor operations.

Streams, events, the architecture and memory queries, and copies to host memory go through ONE small
interface, :class:`DeviceOps`, looked up per device type with :func:`ops_for`. Nothing here touches CUDA
at import or in a constructor: :class:`CudaOps` calls ``torch.cuda`` only inside its methods, when the
engine actually runs on a CUDA device. Tests supply a fake device with :func:`use` (e.g. a fake CUDA
device whose streams record waits and ``record_stream`` calls, for tensors of ``FakeTensorMode``).

What each method means on a device without streams (CPU): :class:`DeviceOps`' defaults (no streams,
events complete at once, host reads free, no architecture).

A leaf module: it imports nothing of the package, so every part (kernels, transport, core) may use it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch

__all__ = ["DeviceOps", "CudaOps", "ops_for", "use", "to_device", "to_device_together", "held_under_capture",
           "CAPTURED"]


class DeviceOps:
    """A device's streams, events and queries. The base class is a device without streams (CPU):
    every operation runs in program order, so streams and events are no-ops and reading a value on the
    host costs nothing beyond the read."""

    #: whether work runs on streams the host does not wait for (CUDA): a side stream is worth having
    has_streams: bool = False
    #: whether reading a device value on the host is free (no queue of device work to wait for)
    host_reads_free: bool = True

    # ----- streams --------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device`` (None without streams)."""
        return None

    def current_stream(self, device: torch.device) -> Any:
        return None

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context in which ops are queued on ``stream``."""
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """Later work on ``waiter`` waits for the work queued on ``waited`` so far (no host wait)."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``tensor`` is in use on ``stream`` (not reused before that work is done)."""

    # ----- events ---------------------------------------------------------------------------
    def record_event(self, stream: Any = None) -> Any:
        """An event marking the work queued so far on ``stream`` (the current stream if None)."""
        return None

    def event_done(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (never waits)."""
        return True

    def wait_event_host(self, event: Any) -> None:
        """Block the host until the device has passed ``event``: a device-to-host synchronisation."""

    def capturing(self, device: torch.device) -> bool:
        """Whether the current stream of ``device`` is being captured into a graph (CUDA graphs): work is
        recorded for replay, so the host must not read device values, query or wait for events, or decide
        from them (what it decides runs at capture only, never on replay)."""
        return False

    # ----- host memory and queries ------------------------------------------------------------
    def to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``x`` to host memory without blocking the host: ``(host tensor, event)``; the
        host tensor may be read once :meth:`event_done` (or :meth:`wait_event_host`) says so."""
        return x.detach().clone(), None

    def give_host(self, host: torch.Tensor) -> None:
        """``host`` (from :meth:`to_host`) has been read: the device may reuse it for a later copy."""

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``x``, a host tensor (the plan's indices, positions: small), copied to ``device`` without making the host
        wait for the device where the device can."""
        return x.to(device)

    def capability(self, device: torch.device) -> tuple[int, int] | None:
        """The compute architecture ``(major, minor)`` (None: not a GPU)."""
        return None

    def memory(self, device: torch.device) -> tuple[int, int] | None:
        """``(free, total)`` bytes of device memory (None: not known)."""
        return None

    def takes_gqa(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
        """Whether torch's own SDPA, given ``enable_gqa=True``, would hand these ``q, k, v`` (fewer K/V heads than
        query heads) to its ``backend`` kernel (``"flash"`` or ``"cudnn"``) as they are, K/V not expanded: then a
        kernel of ours calls that backend the same way (the kernel reads each K/V head for its group of query
        heads and sums dK/dV over the group itself). No device: never."""
        return False

    def takes_head_dims(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether torch's own SDPA would hand its ``backend`` kernel (``"cudnn"``) these ``q, k`` and ``v`` of
        another head dim (multi-latent attention) as they are, not padded; asked about the head dims alone (K/V in
        q's head count: GQA is :meth:`takes_gqa`'s question, per block). No device: never."""
        return False


class CudaOps(DeviceOps):
    """CUDA through ``torch.cuda`` (called only when a CUDA device is used). Pinned host buffers of
    :meth:`to_host` are reused once given back (:meth:`give_host`): no host allocation per call."""

    has_streams = True
    host_reads_free = False
    #: pinned buffers kept per (shape, dtype): one per layer whose forward ran and backward has not yet
    PINNED_PER_SHAPE = 256
    #: torch's rule's answers kept (per case: shapes included), cleared when full
    CASES_KEPT = 4096

    def __init__(self) -> None:
        self._pinned: dict[tuple, list[torch.Tensor]] = {}  # plain dict: no CUDA call until first used
        self._gqa: dict[tuple, bool] = {}  # torch's rule's answers (takes_gqa, takes_head_dims): once per case
        self._local = threading.local()  # per thread: the events wait_stream re-records (made on first use)

    # Host time: ``torch.cuda.current_stream(None)``, ``torch.cuda.stream(...)`` and ``Event.record()`` without a
    # stream each find the current device through ``torch.cuda.is_available()``, which reads an environment
    # variable every time (~17 times per ring call at P = 2 on an H200). A device index is passed instead.

    def new_stream(self, device):
        return torch.cuda.Stream(device=_index(device))

    def current_stream(self, device):
        return torch.cuda.current_stream(_index(device))

    @contextlib.contextmanager
    def on_stream(self, stream):
        if stream.device_index != torch.cuda.current_device():  # another device: torch's context switches it
            with torch.cuda.stream(stream):
                yield
            return
        before = torch.cuda.current_stream(stream.device_index)
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(before)

    def wait_stream(self, waiter, waited):
        # torch's ``Stream.wait_stream`` makes an event per call: created, recorded, waited on and destroyed, four
        # driver calls (~20 waits per ring call at P = 4). Here one event per waited stream and thread is recorded
        # again each time: two. CUDA's rule makes that the same dependency: a wait uses the event's state at the
        # time it is queued, and a later record does not change it. Per thread, because a record on another thread
        # between this thread's record and its wait would move the state this wait reads (the backward runs on
        # autograd's device thread beside the caller's).
        events = getattr(self._local, "events", None)
        if events is None:
            events = self._local.events = {}
        event = events.get(waited)
        if event is None:
            event = events[waited] = torch.cuda.Event()
        event.record(waited)
        waiter.wait_event(event)

    def record_stream(self, tensor, stream):
        tensor.record_stream(stream)

    def record_event(self, stream=None):
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(torch.cuda.current_device()))
        return event

    def event_done(self, event):
        return event.query()

    def wait_event_host(self, event):
        event.synchronize()

    def capturing(self, device):
        return torch.cuda.is_current_stream_capturing()

    def to_host(self, x):
        key = (tuple(x.shape), x.dtype)
        free = self._pinned.get(key)
        host = free.pop() if free else torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        return host, self.record_event()

    def give_host(self, host):
        if host.is_inference():  # made under torch.inference_mode(): nothing may write it outside that mode
            return
        free = self._pinned.setdefault((tuple(host.shape), host.dtype), [])
        if len(free) < self.PINNED_PER_SHAPE:
            free.append(host)

    def to_device(self, x, device):
        # From pageable host memory a copy makes the host wait for the device's queue (what torch's sync debug mode
        # flags); from pinned memory, non_blocking, it does not, and torch's pinned-memory allocator keeps the staging
        # buffer until the copy has run. Under graph capture a replay would copy again from that buffer, long reused:
        # a plain copy there (which capture refuses: warm up first, as docs/cuda_graphs.md says).
        if x.device.type != "cpu" or not torch.cuda.is_available() or self.capturing(device):
            return x.to(device)
        return x.pin_memory().to(device, non_blocking=True)

    def capability(self, device):
        return torch.cuda.get_device_capability(device)

    def memory(self, device):
        return torch.cuda.mem_get_info(device)

    def takes_gqa(self, backend, q, k, v, causal):
        return self._torch_takes(backend, q, k, v, causal)

    def takes_head_dims(self, backend, q, k, v):
        return self._torch_takes(backend, q, k, v, False, as_mha=True)

    def _torch_takes(self, backend, q, k, v, causal, as_mha=False):
        # torch's own dispatch rule (sdp_utils' can_use_*_attention on these tensors), asked once per case:
        # it depends on the torch build and release (cuDNN takes GQA, and V of another head dim, only on newer ones;
        # head dims over 128 only on some GPUs and cuDNN releases), the GPU, the shapes and whether a backward
        # follows (torch's rule refuses some head dims for cuDNN's backward only). ``as_mha``: asked about the
        # head dims alone, K/V as q's head count (stride-0 views of their first head, no copy: torch's
        # rule reads shapes and the last dim's stride only; cuDNN's does not read the causal flag)
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        key = (backend, as_mha, q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape),
               (q.stride(-1), k.stride(-1), v.stride(-1)), bool(causal), grad)
        hit = self._gqa.get(key)
        if hit is None:
            if as_mha:
                h = q.shape[1]
                k, v = (x if x.shape[1] == h else x[:, :1].expand(-1, h, -1, -1) for x in (k, v))
            can = {"flash": torch.backends.cuda.can_use_flash_attention,
                   "cudnn": torch.backends.cuda.can_use_cudnn_attention}[backend]
            params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, bool(causal), True)
            if len(self._gqa) >= self.CASES_KEPT:  # keyed on shapes, which packed batches vary: bounded
                self._gqa.clear()
            hit = self._gqa[key] = bool(can(params, False))
        return hit


def _index(device: torch.device | int | None) -> int:
    """``device``'s CUDA index; the current device where it names none (``torch.device("cuda")``)."""
    index = device.index if isinstance(device, torch.device) else device
    return torch.cuda.current_device() if index is None else index


_BUILTIN: dict[str, DeviceOps] = {"cuda": CudaOps()}
_DEFAULT = DeviceOps()
_override: dict[str, DeviceOps] = {}


def ops_for(device: torch.device | str) -> DeviceOps:
    """The :class:`DeviceOps` of ``device``'s type (a test's fake where one is installed by :func:`use`)."""
    kind = device if isinstance(device, str) else device.type
    return _override.get(kind) or _BUILTIN.get(kind, _DEFAULT)


@contextlib.contextmanager
def use(device_type: str, ops: DeviceOps) -> Iterator[DeviceOps]:
    """Within the block, devices of ``device_type`` use ``ops`` (tests: a fake device)."""
    before = _override.get(device_type)
    _override[device_type] = ops
    try:
        yield ops
    finally:
        if before is None:
            _override.pop(device_type, None)
        else:
            _override[device_type] = before


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` (:meth:`DeviceOps.to_device`: on CUDA from pinned memory, the host not made to
    wait). Every host-to-device copy of the library's plan tensors goes through here."""
    device = torch.device(device)
    return ops_for(device).to_device(x, device)


def to_device_together(xs: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors on ``device`` in ONE copy through :func:`to_device` where they share a dtype (views of one device
    tensor, each contiguous), else one copy each: a plan's index tensors, which a first call copies together."""
    if len({x.dtype for x in xs}) != 1:
        return [to_device(x, device) for x in xs]
    flat = to_device(torch.cat([x.reshape(-1) for x in xs]), device)
    return [part.view(x.shape) for part, x in zip(flat.split([x.numel() for x in xs]), xs)]


#: device tensors a CUDA graph reads at every replay that were made before its capture (the plans' index tensors and
#: status patterns, kept in caches that evict): held for the process (:func:`held_under_capture`)
CAPTURED: dict[int, torch.Tensor] = {}


def held_under_capture(device: torch.device | str, *tensors: torch.Tensor) -> None:
    """Where ``device``'s stream is being captured into a CUDA graph, hold ``tensors`` for the process: the graph
    reads them at every replay, and a cache that later evicted them would free memory the replay still reads."""
    device = torch.device(device)
    if ops_for(device).capturing(device):
        for t in tensors:
            CAPTURED[id(t)] = t
