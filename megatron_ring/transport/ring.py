"""Ring point-to-point exchange: send one buffer to the next rank while receiving from the previous one.

:class:`Transport` is what the engine needs of a ring (the ring's shape, its failure state and
:meth:`Transport.exchange`); :class:`Ring` implements it over a torch.distributed process group,
:class:`LoopbackRing` copies locally (the benchmark's "compute only" mode, and the single-process case),
and the tests' thread ring (``ThreadRing`` of ``tests/helpers/ring_fakes.py``) through in-memory queues. Every exchange
is asynchronous: :meth:`Ring.exchange` returns at once and :meth:`Exchange.wait` joins it. Every
failure -- when the operations are launched or when they are waited for -- and every time-out becomes
:class:`RingPeerError` naming the peer(s) (global ranks) and the step, after this rank has left its
failure note (:mod:`.failure_notes`).

Backends differ in what one launch returns: gloo gives one Work per operation, so the ring launches
the send and the receive separately and a failure names the one peer involved; NCCL coalesces the
batch into ONE Work, so a failure of it names both neighbours.

The deadline (``timeout_s``): where a wait blocks the host anyway (gloo on CPU), each wait carries the
timeout. Where it does not (CUDA, NCCL: ``work.wait()`` only orders streams, ``work.wait(timeout)``
would block the CPU thread every step), waits carry no timeout and :mod:`.deadline`'s watchdog thread
checks ``is_completed()`` against the deadline, aborts the ring's communicators on expiry and records the
error, which the ring's next launch or wait raises.
"""
from __future__ import annotations

import abc
import datetime
import weakref
from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ring import breakdown
from megatron_ring.transport.deadline import watchdog
from megatron_ring.transport.failure_notes import who_is_lost
from megatron_ring.transport.streams import SideStream, side_stream_for
from megatron_ring.errors import RingOutOfStepError, RingPeerError

__all__ = ["Transport", "Ring", "LoopbackRing", "Exchange", "RingPeerError", "CHANNEL_TAGS", "looks_like_timeout"]

# Distinct tags keep the K/V ring, the dK/dV ring and the status hops of a shortened ring (forward, backward) apart on
# backends that match by tag (gloo).
CHANNEL_TAGS = {"fwd_kv": 11, "bwd_kv": 12, "bwd_dkv": 13, "fwd_status": 14, "bwd_status": 15}

Role = tuple[str, int]  # ("sending to" | "receiving from", peer global rank)



def looks_like_timeout(text: str) -> bool:
    """Whether a backend's error text reports a time-out (gloo: "Timed out waiting ..."; NCCL: "... timed
    out in blocking wait", "Watchdog caught collective operation timeout ... before timing out")."""
    low = text.lower()
    return "timed out" in low or "timing out" in low or "operation timeout" in low


def _supports_coalescing(group: Any, device: torch.device) -> bool:
    """True where ``batch_isend_irecv`` returns one Work for the whole batch (NCCL)."""
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except Exception:  # noqa: BLE001 - unknown backend object: treat as one Work per operation
        return False


class Exchange:
    """An exchange in flight; :meth:`wait` blocks until both the send and the receive are done.

    ``pending`` pairs the roles (peer and direction) each launched batch covers with its Works.
    """

    def __init__(self, ring: "Transport", pending: list[tuple[tuple[Role, ...], list[Any]]], channel: str,
                 step: int) -> None:
        self._ring, self._pending, self._channel, self._step = ring, pending, channel, step
        self._done = False

    def wait(self) -> None:
        """Join the exchange (a second call returns at once)."""
        if self._done:
            return
        ring = self._ring
        ring.raise_if_failed()
        host_timeout = ring.timeout if not ring.watchdog_deadline else None
        for roles, works in self._pending:
            for work in works:
                try:
                    ok = work.wait(host_timeout) if host_timeout is not None else work.wait()
                except Exception as exc:  # noqa: BLE001 - re-raised with the peer named
                    ring.raise_if_failed()  # the watchdog's diagnosis (it aborted the communicator)
                    raise ring.peer_error(roles, self._channel, self._step, exc=exc) from exc
                if ok is False:
                    raise ring.peer_error(roles, self._channel, self._step, timed_out=True)
        self._pending = []
        self._done = True
        ring.stream.join()


class Transport(abc.ABC):
    """A ring of ``world`` ranks: rank r sends to r+1 and receives from r-1 (group ranks).

    The state every transport shares is set here, once: ``members`` are the global ranks of the group
    ranks (peers and errors are named by global rank), ``timeout`` the deadline of a wait,
    ``watchdog_deadline`` whether waits leave the deadline to :mod:`.deadline`'s watchdog (they do not
    block the host), ``failure`` the watchdog's recorded error, ``bytes_sent`` per channel. A transport
    only says how an exchange travels (:meth:`exchange`)."""

    def __init__(self, world: int, rank: int, members: Sequence[int], *, group: Any = None,
                 timeout_s: float | None = None, stream: SideStream | None = None, coalesced: bool = False,
                 watchdog_deadline: bool = False) -> None:
        self.group = group
        self.world, self.rank = world, rank
        self.members = list(members)
        self.my_global = self.members[rank]
        self.next_global = self.members[(rank + 1) % world]
        self.prev_global = self.members[(rank - 1) % world]
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.stream: SideStream = stream if stream is not None else SideStream(torch.device("cpu"))
        self.coalesced = coalesced
        self.watchdog_deadline = watchdog_deadline
        self.failure: RingPeerError | None = None  # set by the watchdog; raised by the next launch/wait
        self.bytes_sent: Counter[str] = Counter()
        #: forward rings run on this transport (alike on every rank whose calls are in step): the number a
        #: backward ring's status is keyed on (core/backward_check.py: BackwardTag)
        self.forward_rings = 0
        #: status checks earlier calls left for a later call's (CUDA: backward rings', forward rings' without a
        #: backward; core/status.py: defer)
        self.unchecked: list = []

    @abc.abstractmethod
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""

    @property
    def group(self) -> Any:
        """The process group (None for a loopback). Held weakly where the group allows it: a transport kept in its
        group's context (:class:`~.groups.GroupContext`) must not keep its group alive, so the context goes with
        the group once torch.distributed has destroyed it and nobody else holds it."""
        ref = self._group_ref
        return ref() if isinstance(ref, weakref.ref) else ref

    @group.setter
    def group(self, group: Any) -> None:
        try:
            self._group_ref: Any = weakref.ref(group) if group is not None else None
        except TypeError:  # an object without weak references (a test's stand-in): held as it is
            self._group_ref = group

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise type(self.failure)(str(self.failure)) from self.failure

    def sent_bytes(self) -> int:
        """Bytes sent on this ring so far (every transport counts them per channel at each exchange's launch)."""
        return sum(self.bytes_sent.values())

    def abandon(self, exc: BaseException, ring: str) -> None:
        """This rank leaves a ring in its middle: ``exc`` was raised after the ring's first exchange and before
        its last one completed (the ``ring``: ``forward`` or ``backward``). Its neighbours may hold messages it
        never received, or wait for ones it never sent, and a later exchange would be matched with them: every
        later call on this transport raises :class:`~megatron_ring.errors.RingOutOfStepError` instead."""
        if isinstance(self.failure, RingOutOfStepError):
            return
        self.failure = RingOutOfStepError(
            f"ring attention: this ring is out of step: an earlier call on it raised in the middle of its {ring} "
            f"ring (this is global rank {self.my_global}): {type(exc).__name__}: {exc}. Its neighbours may hold "
            "messages this rank never received, or wait for ones it never sent, and a later call would take them "
            "as its own K/V. Recreate the context-parallel process group (or restart the job) before the next "
            "call.")

    def abort_communicators(self) -> None:
        """Abort the ring group's communicators (releases device streams stuck on a dead peer)."""
        self.group.abort()

    def lost_rank_note(self, blamed: int | Sequence[int], timed_out: bool) -> str:
        """Text naming the rank that is really lost (see :mod:`.failure_notes`)."""
        return who_is_lost(self.members, self.my_global, blamed, timed_out)

    def group_error(self, what: str, exc: BaseException | None = None) -> RingPeerError:
        """The error for a failed collective over the ring's group (``what`` it was for, e.g. the cross-rank
        check), which names no peer: the lost rank is looked for from both ring neighbours (failure
        notes, :mod:`.failure_notes`)."""
        timed_out = exc is None or looks_like_timeout(str(exc))
        detail = f": {exc}" if exc is not None else f": timed out after {self.timeout}"
        return RingPeerError(
            f"ring attention: {what} over the ring's group failed (this is global rank {self.my_global}){detail}. "
            "A rank of the group has probably died or stalled; check its log."
            + self.lost_rank_note([self.prev_global, self.next_global], timed_out=timed_out))

    def peer_error(self, roles: Sequence[Role], channel: str, step: int, exc: BaseException | None = None,
                   timed_out: bool = False, at_launch: bool = False, detail: str = "") -> RingPeerError:
        """The error for a failed exchange with ``roles``; writes this rank's failure note first."""
        timed_out = timed_out or (exc is not None and looks_like_timeout(str(exc)))
        if len(roles) == 1:
            who = f"{roles[0][0]} ring peer global rank {roles[0][1]}"
        else:
            who = "exchanging with " + " and ".join(f"ring peer global rank {p} ({r})" for r, p in roles)
        what = (f"timed out after {self.timeout}" if timed_out and exc is None
                else "failed to start" if at_launch else "failed")
        # an exception without text (a peer's thread or process that stopped) is named by its type
        detail = f": {str(exc) or type(exc).__name__}" if exc is not None else f": {detail}" if detail else ""
        return RingPeerError(
            f"ring attention: {who} {what} at {channel} step {step} (this is global rank {self.my_global})"
            f"{detail}. The peer process or its node has probably died or stalled; check its log."
            + self.lost_rank_note([p for _, p in roles], timed_out=timed_out))



class Ring(Transport):
    """The ring over a torch.distributed process group."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float | None = None) -> None:
        world = dist.get_world_size(group)
        # P2P peers are GLOBAL ranks even when a group is given.
        members = [dist.get_global_rank(group, i) for i in range(world)]
        coalesced = _supports_coalescing(group, device)
        # Waits that do not block the host get their deadline from the watchdog (see module doc).
        super().__init__(world, dist.get_rank(group), members, group=group, timeout_s=timeout_s,
                         stream=side_stream_for(device), coalesced=coalesced,
                         watchdog_deadline=coalesced or device.type == "cuda")

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        tag = CHANNEL_TAGS[channel]
        send_role, recv_role = ("sending to", self.next_global), ("receiving from", self.prev_global)
        send_op = dist.P2POp(dist.isend, send, self.next_global, self.group, tag)
        recv_op = dist.P2POp(dist.irecv, recv, self.prev_global, self.group, tag)
        # Without coalescing (gloo) batch_isend_irecv issues the operations one by one anyway; one call
        # per operation tells which peer a launch failure concerns. NCCL gets one batch (one Work).
        batches = ([((send_role, recv_role), [send_op, recv_op])] if self.coalesced
                   else [((send_role,), [send_op]), ((recv_role,), [recv_op])])
        pending: list[tuple[tuple[Role, ...], list[Any]]] = []
        self.raise_if_failed()
        # the deadline's watch (an event per launch, queried by the watchdog thread) is left out while the
        # stream is captured into a CUDA graph: a query during capture invalidates it, and replays have no
        # Work objects to watch (NCCL's own watchdog keeps the time-out there)
        watched = self.watchdog_deadline and self.timeout is not None and not self.stream.capturing()
        with breakdown.section(step, "launch"), self.stream.launch(send, recv):
            started = self.stream.marker() if watched else None
            for roles, ops in batches:
                try:
                    pending.append((roles, list(dist.batch_isend_irecv(ops))))
                except Exception as exc:  # noqa: BLE001 - e.g. gloo: the peer's connection already closed
                    raise self.peer_error(roles, channel, step, exc=exc, at_launch=True) from exc
        if watched:
            for roles, works in pending:
                watchdog.watch(self, roles, works, channel, step, started)
        self.bytes_sent[channel] += send.numel() * send.element_size()
        return Exchange(self, pending, channel, step)


class LoopbackRing(Transport):
    """Same schedule, no network: "receives" a local copy of what it sends (compute-only timing). The copy
    runs on the device's side stream, as a real exchange would (a no-op seam on CPU)."""

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        super().__init__(world, rank, range(world), stream=side_stream_for(torch.device(device)))

    def abandon(self, exc: BaseException, ring: str) -> None:
        """Nothing to do: a loopback's exchanges are local copies, complete when launched (no neighbour)."""

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, channel: str, step: int) -> Exchange:
        with self.stream.launch(send, recv):
            recv.copy_(send)
        self.bytes_sent[channel] += send.numel() * send.element_size()
        return Exchange(self, [], channel, step)
