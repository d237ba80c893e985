"""After a ring failure: find which rank is really lost, by notes left on the job's store.

Every rank whose ring exchange fails writes a note naming the peer(s) it blames: one peer when the
failed operation had one peer (gloo: one Work per send or receive), both neighbours when it had two
(NCCL: one coalesced Work for the send and the receive). A blamed rank that left a note is alive (it
failed because of someone else), so following the notes leads to the rank(s) that left none: that one
(or its node) is lost. A missing note is awaited up to ``wait_s`` after a time-out (neighbours time out
at about the same moment) and up to ``grace_s`` after a closed connection: a peer whose own wait just
timed out closes its connections a moment *before* it writes its note, so a closed connection alone
does not prove the peer died unreported. The walk runs in a daemon thread joined for at most
``wait_s + 1`` seconds, because the store itself may have lived on the lost node. Best effort: it only
adds text to the error.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import torch.distributed as dist

__all__ = ["who_is_lost"]


def who_is_lost(members: Sequence[int], me: int, blamed: int | Sequence[int], timed_out: bool,
                wait_s: float = 2.0, grace_s: float = 1.0) -> str:
    """A bracketed sentence naming the lost global rank (or why it could not be found).

    ``blamed`` is the peer (or the peers, in order of suspicion) this rank's failed operation involved.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group / store: nothing to consult
        return ""
    suspects = [blamed] if isinstance(blamed, int) else list(dict.fromkeys(blamed))
    key = "megatron_ring/failure/" + "-".join(map(str, members)) + "/"
    result = [" [could not consult the job's store in time; if it lived on the lost node, that node is the "
              "MASTER_ADDR host]"]

    def walk() -> None:
        store.set(key + str(me), ",".join(map(str, suspects)))
        chain, silent, todo = [me], [], list(suspects)
        deadline = time.monotonic() + (wait_s if timed_out else grace_s)
        while todo:
            cur = todo.pop(0)
            if cur in chain or cur in silent:
                continue
            while not store.check([key + str(cur)]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not store.check([key + str(cur)]):
                silent.append(cur)
                continue
            chain.append(cur)
            todo += [int(x) for x in store.get(key + str(cur)).decode().split(",") if x]
        path = " -> ".join(map(str, chain + silent[:1]))
        if len(silent) == 1:
            result[0] = (f" [failure chain {path}: global rank {silent[0]} left no failure note, so it (or its "
                         "node) is the one lost, or it is alive and making another call: check that every rank "
                         "makes the same sequence of ring_attention calls]")
        elif silent:
            result[0] = (f" [failure chain {path}: global ranks {', '.join(map(str, silent))} left no failure "
                         "note; one of them (or its node) is lost, or they are alive and making another call: check "
                         "that every rank makes the same sequence of ring_attention calls]")
        else:
            result[0] = f" [failure chain {' -> '.join(map(str, chain))}: every rank on it reported]"

    thread = threading.Thread(target=walk, name="megatron-ring-failure-notes", daemon=True)
    thread.start()
    thread.join(wait_s + 1.0)
    return result[0]
