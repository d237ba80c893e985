"""Device-agnostic stream seam for the ring exchange.

On CUDA the P2P exchange is launched on a dedicated side stream: the side stream first waits for the
compute stream (the send buffer is ready), and the compute stream waits for the side stream when the
exchange is joined (the received buffer is ready). Buffers touched on the side stream are recorded on it
so the caching allocator does not reuse them early. On CPU there are no streams and every method is a
no-op, so CPU tests run exactly the same engine code.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["SideStream", "side_stream_for"]


class SideStream:
    """A communication stream for ``device`` (a no-op object on devices without streams)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def launch(self, *buffers: torch.Tensor) -> Iterator[None]:
        """Run the enclosed communication calls on the side stream, after current compute."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        for buf in buffers:
            buf.record_stream(self.stream)

    def marker(self):
        """Inside :meth:`launch`: a callable telling whether the device has reached this point of the side
        stream (a recorded CUDA event; None on devices without streams: reached at once)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.query

    def join(self) -> None:
        """Make the compute stream wait for everything launched so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


_streams: dict[torch.device, SideStream] = {}


def side_stream_for(device: torch.device) -> SideStream:
    """One cached side stream per device."""
    if device not in _streams:
        _streams[device] = SideStream(device)
    return _streams[device]
