"""After a ring failure: find which rank is really lost, by notes left on the job's store.

Every rank whose ring wait fails writes a note naming the peer it blames. A blamed rank that left a note
is alive (it failed because of someone else), so following the notes leads to the rank that left none:
that one (or its node) is lost. A missing note is awaited up to ``wait_s`` after a time-out (neighbours
time out at about the same moment) and up to ``grace_s`` after a closed connection: a peer whose own
wait just timed out closes its connections a moment *before* it writes its note, so a closed connection
alone does not prove the peer died unreported. The walk runs in a daemon thread joined for at most
``wait_s + 1`` seconds, because the store itself may have lived on the lost node. Best effort: it only
adds text to the error.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import torch.distributed as dist

__all__ = ["who_is_lost"]


def who_is_lost(members: Sequence[int], me: int, blamed: int, timed_out: bool, wait_s: float = 2.0,
                grace_s: float = 1.0) -> str:
    """A bracketed sentence naming the lost global rank (or why it could not be found)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group / store: nothing to consult
        return ""
    key = "megatron_ring/failure/" + "-".join(map(str, members)) + "/"
    result = [" [could not consult the job's store in time; if it lived on the lost node, that node is the "
              "MASTER_ADDR host]"]

    def walk() -> None:
        store.set(key + str(me), str(blamed))
        chain, cur = [me], blamed
        deadline = time.monotonic() + (wait_s if timed_out else grace_s)
        while cur not in chain:
            chain.append(cur)
            while not store.check([key + str(cur)]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not store.check([key + str(cur)]):
                result[0] = (f" [failure chain {' -> '.join(map(str, chain))}: global rank {cur} left no "
                             "failure note, so it (or its node) is the one lost]")
                return
            cur = int(store.get(key + str(cur)).decode())
        result[0] = f" [failure chain {' -> '.join(map(str, chain + [cur]))}: every rank on it reported]"

    thread = threading.Thread(target=walk, name="megatron-ring-failure-notes", daemon=True)
    thread.start()
    thread.join(wait_s + 1.0)
    return result[0]
