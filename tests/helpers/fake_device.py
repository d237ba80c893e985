"""Fake devices for the device seam (megatron_ring/device.py) and the checkers that use them.

* :class:`FakeCuda`: a device with streams whose streams and events are Python objects. It keeps a
  logical clock per stream; :class:`StreamChecker` (a dispatch mode) uses it to check every tensor op
  against the stream it runs on: a tensor written on one stream and used on another needs a
  ``wait_stream`` after that write (every consumer waits), and every tensor used on the side stream is
  ``record_stream``-ed on it. With ``FakeTensorMode`` it stands in for CUDA on a machine without one;
  with CPU tensors it makes the engine take the CUDA code path (status read in the backward, not in the
  forward) while the ops still compute.
* :class:`HostReadCounter`: counts device-to-host synchronisations of the values that come from the
  inputs (taint tracking through every op, so host-side plan tensors such as positions never count):
  ``_local_scalar_dense`` (``item()``, ``bool()``, ``int()``...), ``nonzero``, ``is_nonzero``,
  ``equal``, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, ``tolist()``,
  ``numpy()``, plus the fake device's host waits (:meth:`FakeCuda.wait_event_host`).
* :class:`HostTransferCounter`: on the fake-CUDA tier (``FakeTensorMode``), counts host<->device transfers in
  both directions: reads of CUDA values and copies to the host, and host-to-device copies (``.to``,
  ``copy_``, a CPU index or mask used in a CUDA op).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:
    from megatron_ring.device import DeviceOps
except ImportError:  # a tree before the device seam (the counter alone still works there)
    DeviceOps = object


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0  # ops queued so far
        self.seen: dict[str, int] = {}  # other stream -> its clock at our last wait for it
        self.recorded: set[int] = set()  # storages record_stream-ed on this stream

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, stream: FakeStream, done: bool) -> None:
        self.stream, self.clock, self.done = stream, stream.clock, done


class FakeCuda(DeviceOps):
    """A device with streams (see the module doc). ``events_done``: what :meth:`event_done` answers
    (False models a host that runs ahead of the device: the status read then waits)."""

    has_streams = True
    host_reads_free = False

    def __init__(self, capability=(9, 0), events_done: bool = True, capturing: bool = False,
                 gqa: bool = True, head_dims: bool = False) -> None:
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.streams = [self.compute]
        self.cap = capability
        self.events_done = events_done
        self.log: Counter[str] = Counter()
        self.host_waits = 0
        self.capture = capturing  # models a stream being captured into a CUDA graph
        self.gqa = gqa  # what takes_gqa answers (True: a torch whose flash and cuDNN kernels take GQA K/V)
        self.head_dims = head_dims  # what takes_head_dims answers (True: cuDNN takes V of another head dim)

    def new_stream(self, device):
        s = FakeStream(f"side{len(self.streams)}")
        self.streams.append(s)
        self.log["new_stream"] += 1
        return s

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def on_stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def wait_stream(self, waiter, waited):
        waiter.seen[waited.name] = waited.clock
        self.log["wait_stream"] += 1

    def record_stream(self, tensor, stream):
        stream.recorded.add(_key(tensor))
        self.log["record_stream"] += 1

    def record_event(self, stream=None):
        self.log["record_event"] += 1
        return FakeEvent(stream or self.current, self.events_done)

    def event_done(self, event):
        self.log["event_query"] += 1
        return event.done

    def capturing(self, device):
        return self.capture

    def wait_event_host(self, event):
        self.host_waits += 1
        event.done = True

    def to_host(self, x):
        self.log["to_host"] += 1
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        if isinstance(x, FakeTensor):  # nothing computed: a fake device carries no failure
            with unset_fake_temporarily():
                return torch.zeros(x.shape, dtype=x.dtype), self.record_event()
        host = x.detach().clone()
        host._host_copy = True  # a host copy: reading it is no device sync (HostReadCounter)
        return host, self.record_event()

    def to_device(self, x, device):
        self.log["to_device"] += 1  # a host-to-device copy through the seam (CUDA: pinned, non_blocking)
        return x.to(device)

    def capability(self, device):
        return self.cap

    def takes_gqa(self, backend, q, k, v, causal):
        return self.gqa

    def takes_head_dims(self, backend, q, k, v):
        return self.head_dims

    def memory(self, device):
        return (80 << 30, 80 << 30)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree):
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _written_args(func, args, kwargs):
    """The tensor arguments ``func`` writes (its schema's mutable arguments)."""
    out = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(arg.name)
            out += _tensors(val)
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` covers (an over-estimate for gapped views: their whole extent)."""
    if t.numel() == 0:
        return 0, 0
    lo = t.storage_offset()
    hi = lo + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo * t.element_size(), hi * t.element_size()


class StreamChecker(TorchDispatchMode):
    """Checks each op against the fake device's streams (see the module doc): ``problems`` lists the
    violations (the test asserts it is empty), :meth:`unrecorded` what a side stream used unrecorded.

    Each op on stream S reads its tensor arguments and writes its mutable arguments and outputs (byte
    ranges of their storages). An access that overlaps a write (or, for a write, a read) made on another
    stream O at O's clock c is ordered only if S waited for O at or after c (``wait_stream``). View ops and
    metadata queries (``prim.device``: FakeTensorMode dispatches ``t.device``) touch no data and are not
    accesses."""

    def __init__(self, dev: FakeCuda) -> None:
        super().__init__()
        self.dev = dev
        # storage -> [(lo, hi, stream, clock, is_write)] of accesses not yet known to be ordered for all
        self.access: dict[int, list[tuple[int, int, FakeStream, int, bool]]] = {}
        self.alive: dict[int, object] = {}  # keeps the storages alive, so no key is reused
        self.side_used: dict[int, str] = {}
        self.side_allocated: set[int] = set()
        self.problems: list[str] = []
        self.ops_on: Counter[str] = Counter()

    def _check(self, func, stream: FakeStream, t: torch.Tensor, write: bool) -> None:
        k = _key(t)
        self.alive[k] = t.untyped_storage()
        lo, hi = _span(t)
        keep = []
        for a in self.access.get(k, []):
            alo, ahi, other, clock, awrite = a
            ordered = other is stream or stream.seen.get(other.name, -1) >= clock
            if not ordered and (write or awrite) and lo < ahi and alo < hi:
                self.problems.append(f"{func} on {stream.name} {'writes' if write else 'reads'} bytes "
                                     f"[{lo}, {hi}) {'written' if awrite else 'read'} on {other.name} at "
                                     f"{clock} without waiting for it")
            # an access every other stream has waited for can never conflict again
            if not all(s is other or s.seen.get(other.name, -1) >= clock for s in self.dev.streams):
                keep.append(a)
        self.access[k] = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stream = self.dev.current
        stream.clock += 1
        self.ops_on[stream.name] += 1
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or func is torch.ops.prim.device.default:
            return out
        written = _written_args(func, args, kwargs)
        wkeys = {id(t) for t in written}
        args_t = _tensors((args, kwargs))
        for t in args_t:
            if id(t) not in wkeys:
                self._check(func, stream, t, False)
        for t in written + _tensors(out):
            self._check(func, stream, t, True)
        for t in args_t:
            lo, hi = _span(t)
            self.access.setdefault(_key(t), []).append((lo, hi, stream, stream.clock, id(t) in wkeys))
            if stream is not self.dev.compute:
                self.side_used.setdefault(_key(t), f"{func}")
        arg_keys = {_key(a) for a in args_t}
        for t in _tensors(out):
            lo, hi = _span(t)
            self.access.setdefault(_key(t), []).append((lo, hi, stream, stream.clock, True))
            if stream is not self.dev.compute and _key(t) not in arg_keys:
                self.side_allocated.add(_key(t))
        return out

    def unrecorded(self) -> list[str]:
        """Storages used on a side stream that were neither recorded on it nor allocated there."""
        recorded = set().union(*(s.recorded for s in self.dev.streams[1:])) if len(self.dev.streams) > 1 else set()
        return [what for k, what in self.side_used.items() if k not in recorded and k not in self.side_allocated]


_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
             "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
             "aten::unique_consecutive", "aten::nonzero_static", "aten::item"}


class _TaintDispatch(TorchDispatchMode):
    def __init__(self, counter: "HostReadCounter") -> None:
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _tensors((args, kwargs))
        tainted = any(self.c.is_tainted(t) for t in ins)
        name = func._schema.name
        if tainted and (name in _SYNC_OPS or (name == "aten::repeat_interleave" and len(ins) == 1
                                               and args and isinstance(args[0], torch.Tensor)
                                               and kwargs.get("output_size") is None
                                               and func._overloadname == "Tensor")):
            self.c.reads[name] += 1
        out = func(*args, **kwargs)
        if tainted:
            for t in _written_args(func, args, kwargs) + _tensors(out):
                self.c.taint(t)
        return out


class _TaintFunction(TorchFunctionMode):
    def __init__(self, counter: "HostReadCounter") -> None:
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("tolist", "numpy", "__array__") and args and self.c.is_tainted(args[0]) \
                and not getattr(args[0], "_host_copy", False):
            self.c.reads[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


class HostReadCounter:
    """Counts host reads of values derived from the tensors passed to :meth:`taint` (see the module doc).
    ``with counter: ...`` counts; ``counter.total()`` (plus the fake device's host waits)."""

    def __init__(self, dev: FakeCuda | None = None) -> None:
        self.dev = dev
        self.reads: Counter[str] = Counter()
        self._tainted: dict[int, object] = {}
        self._modes: list = []

    def taint(self, *ts: torch.Tensor) -> None:
        for t in ts:
            self._tainted[_key(t)] = t.untyped_storage()

    def is_tainted(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _key(t) in self._tainted

    def __enter__(self):
        self._waits0 = self.dev.host_waits if self.dev is not None else 0
        self._modes = [_TaintFunction(self), _TaintDispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        if self.dev is not None:
            waits = self.dev.host_waits - self._waits0
            if waits:
                self.reads["host wait (event)"] += waits
        return False

    def total(self) -> int:
        return sum(self.reads.values())


_COPY_OPS = {"aten::_to_copy", "aten::copy_", "aten::copy", "aten::to"}


def _on(t: torch.Tensor, kind: str) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == kind


class HostTransferCounter(TorchDispatchMode):
    """Counts host<->device transfers on the fake-CUDA tier (``FakeTensorMode`` with ``cuda`` tensors), BOTH
    directions, op by op (enter it inside the fake mode, so it sees each op's arguments as the caller gave
    them):

    * ``device->host``: a synchronising read of a CUDA tensor (the ops :class:`HostReadCounter` counts) or a
      copy from a CUDA tensor into a CPU one;
    * ``host->device``: a copy from a CPU tensor into a CUDA one (``.to``, ``copy_``; a copy from pageable
      host memory synchronises the host with the device, so the steady state must make none), or an op
      on CUDA tensors that takes a CPU tensor of one element or more dimensions (an index, a mask: torch
      copies it to the device first). A 0-dim CPU tensor in a CUDA op is a scalar, read on the host: not
      a transfer.

    ``counts`` maps ``"<direction> <op>"`` to how many times it happened; ``total()``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if name in _COPY_OPS:
            src = args[1] if name == "aten::copy_" else args[0]
            dst = args[0] if name == "aten::copy_" else (outs[0] if outs else None)
            if _on(src, "cpu") and _on(dst, "cuda"):
                self.counts[f"host->device {name}"] += 1
            elif _on(src, "cuda") and _on(dst, "cpu"):
                self.counts[f"device->host {name}"] += 1
        elif name in _SYNC_OPS and any(_on(t, "cuda") for t in ins):
            self.counts[f"device->host {name}"] += 1
        elif any(_on(t, "cuda") for t in ins + outs) and any(_on(t, "cpu") and t.dim() > 0 for t in ins):
            self.counts[f"host->device {name}"] += 1
        return out

    def total(self) -> int:
        return sum(self.counts.values())
