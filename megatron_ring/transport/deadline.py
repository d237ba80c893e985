"""The ring's deadline on devices whose waits do not block the host (CUDA / NCCL).

On NCCL, ``work.wait()`` only makes the current CUDA stream wait for the communication; the CPU thread
runs on. ``work.wait(timeout)`` would instead block the CPU thread until the work completes -- one host
synchronisation per ring step, which would serialise the CPU's kernel launches with the GPU. So there the
ring waits without a timeout and a :class:`RingWatchdog` (one daemon thread per process) enforces the
deadline: it polls ``work.is_completed()`` of every exchange in flight; an exchange not completed
``timeout`` after the GPU reached it (a CUDA event recorded just before the launch; on devices without
one, from the launch) fails its ring: the watchdog writes the failure note, logs the error, records it on
the ring -- the next launch or wait of that ring raises it -- and aborts the ring's communicators, so a
GPU stream (and any host synchronisation behind it) stuck on the dead peer is released. The collective
strategies' collectives (:mod:`.collectives`) are watched the same way, over the transport of their group
(no ``roles``: the error names the collective and its group).

The error text follows NCCL's own watchdog ("Watchdog caught collective operation timeout: WorkNCCL(...)
ran for N milliseconds before timing out"), so log searches for NCCL time-outs find it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["RingWatchdog", "watchdog", "timeout_seconds"]

log = logging.getLogger("megatron_ring")


def timeout_seconds(ring: Any) -> float | None:
    """A ring's deadline (``ring.timeout``, a ``timedelta`` or None) in seconds, as the collectives take it."""
    return None if ring.timeout is None else ring.timeout.total_seconds()


@dataclass
class _Watch:
    ring: Any
    roles: tuple
    works: list
    channel: str
    step: int
    started: Callable[[], bool] | None
    since: float | None = field(default=None)


class RingWatchdog:
    """Polls in-flight exchanges against their ring's deadline from a daemon thread."""

    def __init__(self, poll_s: float = 0.02) -> None:
        self.poll_s = poll_s
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, ring: Any, roles: tuple, works: list, channel: str, step: int,
              started: Callable[[], bool] | None) -> None:
        """Watch ``works`` (an exchange of ``ring``, or with no ``roles`` a collective over its group named
        ``channel``); ``started()`` says whether the device reached it."""
        w = _Watch(ring, roles, list(works), channel, step, started,
                   time.monotonic() if started is None else None)
        with self._lock:
            self._watches.append(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="megatron-ring-watchdog", daemon=True)
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._watches)

    def _run(self) -> None:
        while True:
            with self._lock:
                watches = list(self._watches)
            if not watches:
                with self._lock:
                    if not self._watches:
                        self._thread = None
                        return
                continue
            for w in watches:
                verdict = self._check(w)
                if verdict is None:
                    continue
                with self._lock:
                    self._watches = [x for x in self._watches if x is not w and
                                     not (verdict != "done" and x.ring is w.ring)]
                if verdict != "done":
                    self._fail(w, verdict)
            time.sleep(self.poll_s)

    @staticmethod
    def _check(w: _Watch) -> str | None | BaseException:
        """"done", None (still running, in time), "timeout", or the exception the work reported."""
        if w.ring.failure is not None:
            return "done"  # the ring already failed (and raised); nothing more to report
        try:
            if all(work.is_completed() for work in w.works):
                return "done"
        except Exception as exc:  # noqa: BLE001 - e.g. NCCL reports an asynchronous error
            return exc
        now = time.monotonic()
        if w.since is None:
            try:
                if w.started is not None and not w.started():
                    return None
            except Exception:  # noqa: BLE001 - cannot ask the device: count from now
                pass
            w.since = now
        limit = timeout_seconds(w.ring)
        if limit is not None and now - w.since > limit:
            return "timeout"
        return None

    @staticmethod
    def _fail(w: _Watch, verdict: str | BaseException) -> None:
        ring = w.ring
        ran_ms = int((time.monotonic() - (w.since or time.monotonic())) * 1000)
        if not w.roles:  # a collective over the transport's group (collectives.py): no one peer to name
            error = ring.group_error(w.channel, exc=TimeoutError(
                f"Watchdog caught collective operation timeout (Timeout(ms)={int(timeout_seconds(ring) * 1000)}): "
                f"it ran for {ran_ms} milliseconds before timing out") if verdict == "timeout" else verdict)
        elif verdict == "timeout":
            error = ring.peer_error(w.roles, w.channel, w.step, timed_out=True,
                                    detail=f"Watchdog caught ring exchange timeout (Timeout(ms)="
                                           f"{int(timeout_seconds(ring) * 1000)}): it ran for "
                                           f"{ran_ms} milliseconds before timing out")
        else:
            error = ring.peer_error(w.roles, w.channel, w.step, exc=verdict)  # type: ignore[arg-type]
        ring.failure = error
        log.error("%s", error)
        try:
            ring.abort_communicators()
        except Exception as exc:  # noqa: BLE001 - best effort; the error is recorded either way
            log.error("megatron_ring: aborting the ring's communicators failed: %s", exc)


watchdog = RingWatchdog()
