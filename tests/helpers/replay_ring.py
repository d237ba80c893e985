"""P ranks of one ring on ONE device, one rank at a time, forward AND backward: no thread, no wait.

Why not threads (``ring_fakes.ThreadRing``) on CUDA: torch's autograd engine runs every CUDA node of every
backward on one worker thread per device (the calling thread only drives CPU nodes), so rank 0's
backward, blocked in a receive, holds that thread while the rank it waits for is queued behind it.

Here each rank runs alone, start to end, on a :class:`ReplayRing`: a send is recorded under the key its
receiver reads it by (receiver, channel, n: the n-th message on that channel, the FIFO order of a real
ring), and a receive is filled at once from the record (zeros while the sender has not run yet).
Ranks run in passes (0..P-1 each pass). Exact after enough passes: a rank's i-th exchange sends what it
computed from its receives 0..i-1 only, so after pass n every send of index < n is the real one; with L
exchanges per rank, pass L + 1 runs every rank on the real messages. It stops earlier when a pass sent
bitwise the same messages as the one before (a consistent run: every rank consumed what was sent).
Nothing ever blocks, so nothing can deadlock; a rank that raises on an unfinished pass's placeholder
data is run again on the next pass, and only the final pass's results and errors count.
"""
from __future__ import annotations

from collections import Counter

import torch

from megatron_ring.transport.ring import Exchange, LoopbackRing


class ReplayRing(LoopbackRing):
    """One rank of ``world`` on ``device``: sends go into ``sent``, receives come from ``record``."""

    def __init__(self, world: int, rank: int, device, record: dict, sent: dict) -> None:
        super().__init__(world, rank, torch.device(device))
        self.record, self.sent, self.count, self.missing = record, sent, Counter(), 0

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        n = self.count[channel]
        self.count[channel] += 1
        with self.stream.launch(send, recv):
            self.sent[((self.rank + 1) % self.world, channel, n)] = send.detach().clone()
            got = self.record.get((self.rank, channel, n))
            if got is None or got.shape != recv.shape or got.dtype != recv.dtype:
                self.missing += 1
                recv.zero_()
            else:
                recv.copy_(got)
        self.bytes_sent[channel] += send.numel() * send.element_size()
        return Exchange(self, [], channel, step)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def run_replayed(fn, world: int, device="cpu", max_passes: int | None = None, stop_after: int | None = None):
    """``fn(rank, ring)`` for every rank (forward and backward inside ``fn``, e.g. ``torch.autograd.grad``);
    returns ``(results, passes)``: per-rank results of the exact pass (or the exception a rank raised on it).
    ``stop_after``: return pass ``stop_after``'s results whatever they are (a negative control)."""
    record: dict = {}
    previous: dict | None = None
    passes = 0
    while True:
        passes += 1
        sent: dict = {}
        results, rings = [], []
        for r in range(world):
            ring = ReplayRing(world, r, device, record, sent)
            try:
                results.append(fn(r, ring))
            except Exception as exc:  # noqa: BLE001 - placeholder data on an early pass; kept if final
                results.append(exc)
            record.update(ring.sent)
            rings.append(ring)
        length = max(sum(ring.count.values()) for ring in rings)
        clean = all(ring.missing == 0 for ring in rings)
        if stop_after is not None and passes >= stop_after:
            return results, passes
        if clean and previous is not None and _same(sent, previous):
            return results, passes  # a fixed point: every rank read exactly what was sent
        if clean and passes > length:
            return results, passes  # pass L + 1: every receive was the real message
        if max_passes is not None and passes >= max_passes:
            raise AssertionError(f"replayed ring did not settle in {passes} passes ({length} exchanges a rank)")
        previous = sent
