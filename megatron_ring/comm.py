"""Ring point-to-point exchange: send one buffer to the next rank while receiving from the previous one.

:class:`Ring` wraps a torch.distributed process group; :class:`LoopbackRing` keeps the same interface
but copies locally (the benchmark's "compute only" mode, and the single-process case). Every exchange
is asynchronous: :meth:`Ring.exchange` returns at once and :meth:`Exchange.wait` joins it. Failures and
time-outs become :class:`RingPeerError` naming the peer (global rank) and the step.
"""
from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from .failure_notes import who_is_lost
from .streams import SideStream, side_stream_for

__all__ = ["Ring", "LoopbackRing", "Exchange", "RingPeerError", "CHANNEL_TAGS"]

# Distinct tags keep the K/V ring and the dK/dV ring apart on backends that match by tag (gloo).
CHANNEL_TAGS = {"fwd_kv": 11, "bwd_kv": 12, "bwd_dkv": 13}


class RingPeerError(RuntimeError):
    """A ring neighbour failed, vanished or did not answer in time."""


class Exchange:
    """An exchange in flight; :meth:`wait` blocks until both the send and the receive are done."""

    def __init__(self, ring: "Ring", works: list[Any], channel: str, step: int) -> None:
        self._ring, self._works, self._channel, self._step = ring, works, channel, step

    def wait(self) -> None:
        ring = self._ring
        roles = (("sending to", ring.next_global), ("receiving from", ring.prev_global))
        for (role, peer), work in zip(roles, self._works):
            try:
                ok = work.wait(ring.timeout) if ring.timeout is not None else work.wait()
            except Exception as exc:  # noqa: BLE001 - re-raised with the peer named
                raise RingPeerError(
                    f"ring attention: {role} ring peer global rank {peer} failed at {self._channel} step "
                    f"{self._step} (this is global rank {ring.my_global}): {exc}. The peer process or its "
                    "node has probably died or stalled; check its log."
                    + ring.lost_rank_note(peer, timed_out="Timed out" in str(exc))) from exc
            if ok is False:
                raise RingPeerError(
                    f"ring attention: {role} ring peer global rank {peer} timed out after "
                    f"{ring.timeout} at {self._channel} step {self._step} (this is global rank "
                    f"{ring.my_global})" + ring.lost_rank_note(peer, timed_out=True))
        self._works = []
        ring.stream.join()


class Ring:
    """The ring over a process group: rank r sends to r+1 and receives from r-1 (group ranks)."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2P peers are GLOBAL ranks even when a group is given.
        self.next_global = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev_global = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.my_global = dist.get_global_rank(group, self.rank)
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.stream: SideStream = side_stream_for(device)
        self.bytes_sent: Counter[str] = Counter()

    def lost_rank_note(self, blamed: int, timed_out: bool) -> str:
        """Text naming the rank that is really lost (see :mod:`.failure_notes`)."""
        members = [dist.get_global_rank(self.group, i) for i in range(self.world)]
        return who_is_lost(members, self.my_global, blamed, timed_out)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        tag = CHANNEL_TAGS[channel]
        ops = [dist.P2POp(dist.isend, send, self.next_global, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_global, self.group, tag)]
        with self.stream.launch(send, recv):
            works = dist.batch_isend_irecv(ops)
        self.bytes_sent[channel] += send.numel() * send.element_size()
        return Exchange(self, works, channel, step)


class _DoneWork:
    def wait(self, *_: Any) -> bool:
        return True


class LoopbackRing(Ring):
    """Same schedule, no network: "receives" a local copy of what it sends (compute-only timing)."""

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.group = None
        self.world, self.rank = world, rank
        self.next_global = self.prev_global = self.my_global = rank
        self.timeout = None
        self.stream = SideStream(torch.device("cpu"))  # no side stream: copies run inline
        self.bytes_sent = Counter()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        recv.copy_(send)
        self.bytes_sent[channel] += send.numel() * send.element_size()
        return Exchange(self, [_DoneWork(), _DoneWork()], channel, step)
