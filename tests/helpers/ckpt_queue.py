"""Test-only: the results queue of Megatron's checkpoint writer from a forked Manager, not a spawned one.

Every rank that writes a ``torch_dist`` checkpoint asks
``megatron.core.dist_checkpointing.strategies.filesystem_async`` for its write-results queue, which comes from a
``multiprocessing`` Manager that Megatron starts with ``spawn`` (``get_write_results_queue`` on megatron-core 0.19,
``_get_write_results_queue`` on 0.16): a fresh interpreter that imports the job's script again, torch and Megatron
included. That is about 8.5 s of CPU per writing rank on a 2-core machine (tests/megatron/test_sinks_pretrain.py and
test_resume_cp.py started 12 of them; the first took 185 s of CPU with them, 92 s without). What the tests check
(the ring through Megatron's save and load) does not depend on how that Manager process starts.

Imported by the fork servers the suite's jobs start from (tests/conftest.py adds it to their preload lists), this
module replaces that getter: the Manager is forked from the rank instead (its imports already done). The forked
Manager then closes every socket it inherited (the rank's process-group connections, the fork server's), so a rank
that dies is seen by its peers as before (a Manager holding the rank's sockets open would hide the closed
connection). The queue is made once per rank, on first use, as Megatron makes it. Without megatron-core this does
nothing.
"""
from __future__ import annotations

import multiprocessing
import os
import stat
from multiprocessing.managers import SyncManager

_GETTERS = ("get_write_results_queue", "_get_write_results_queue")  # megatron-core 0.19 / 0.16


def _close_inherited_sockets() -> None:
    """In the forked Manager, before its server starts: close the sockets it inherited from the rank (its own
    listener and its pipe to the rank are made after this, or are not sockets). Where the system lists no
    descriptors there (not Linux), nothing is closed."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the directory's own descriptor, already closed
            pass


def install() -> bool:
    """Replace the getter where this megatron-core has one (True), else leave everything as it is (False)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return False
    names = [n for n in _GETTERS if callable(getattr(fa, n, None))]
    if not names or not hasattr(fa, "_results_queue"):
        return False

    def results_queue(*_args, **_kwargs):
        if fa._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(_close_inherited_sockets)
            fa._results_queue = manager.Queue()  # the proxy keeps its manager (and so its process) alive
        return fa._results_queue

    for name in names:
        setattr(fa, name, results_queue)
    return True


INSTALLED = install()
