"""Device-agnostic stream seam for the ring exchange.

On a device with streams (CUDA) the P2P exchange is launched on a dedicated side stream: the side stream
first waits for the compute stream (the send buffer is ready), and the compute stream waits for the side
stream when the exchange is joined (the received buffer is ready). Buffers touched on the side stream are
recorded on it so the caching allocator does not reuse them early. On CPU there are no streams and every
method is a no-op, so CPU tests run exactly the same engine code.

Every stream and event operation goes through the device seam (:mod:`megatron_ring.device`); the stream
itself is created on first use, never in a constructor, so building a transport touches no device.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from megatron_ring.device import DeviceOps, ops_for

__all__ = ["SideStream", "side_stream_for"]


class SideStream:
    """A communication stream for ``device`` (a no-op object on devices without streams)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._made: tuple[DeviceOps, Any] | None = None  # (the seam that made it, the stream)

    @property
    def stream(self) -> Any:
        """The side stream (None on devices without streams), created on first use by the device's seam."""
        ops = ops_for(self.device)
        if not ops.has_streams:
            return None
        if self._made is None or self._made[0] is not ops:
            self._made = (ops, ops.new_stream(self.device))
        return self._made[1]

    @contextlib.contextmanager
    def launch(self, *buffers: torch.Tensor) -> Iterator[None]:
        """Run the enclosed communication calls on the side stream, after current compute."""
        stream = self.stream
        if stream is None:
            yield
            return
        ops = ops_for(self.device)
        ops.wait_stream(stream, ops.current_stream(self.device))
        with ops.on_stream(stream):
            yield
        for buf in buffers:
            ops.record_stream(buf, stream)

    def capturing(self) -> bool:
        """Whether the device's current stream is being captured into a graph (see ``DeviceOps.capturing``)."""
        return ops_for(self.device).capturing(self.device)

    def marker(self) -> Callable[[], bool] | None:
        """Inside :meth:`launch`: a callable telling whether the device has reached this point of the side
        stream (a recorded event; None on devices without streams: reached at once)."""
        stream = self.stream
        if stream is None:
            return None
        ops = ops_for(self.device)
        event = ops.record_event(stream)
        return lambda: ops.event_done(event)

    def join(self) -> None:
        """Make the compute stream wait for everything launched so far."""
        stream = self.stream
        if stream is not None:
            ops = ops_for(self.device)
            ops.wait_stream(ops.current_stream(self.device), stream)


_streams: dict[torch.device, SideStream] = {}


def side_stream_for(device: torch.device) -> SideStream:
    """One cached side stream per device."""
    if device not in _streams:
        _streams[device] = SideStream(device)
    return _streams[device]
