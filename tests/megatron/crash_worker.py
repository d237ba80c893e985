"""examples/pretrain_ring_gpt_any_cp.py (Megatron-LM's pretrain(), ring attention) with a crash: global rank
``MEGATRON_RING_TEST_KILL_RANK`` SIGKILLs itself when it enters forward step number
``MEGATRON_RING_TEST_KILL_AT`` (1-based, counting micro-batches, so ``2 * (i - 1) + 2`` with 2 micro-batches
per iteration is the middle of iteration ``i``: its first micro-batch's forward and backward are done, the
optimizer step is not), after writing ``time.time()`` to ``MEGATRON_RING_TEST_KILL_NOTE``.

    python crash_worker.py <the example's arguments>     (under torchrun, or one process per rank)

Used by tests/megatron/test_crash_resume.py; nothing else changes (same model, data, loss, checkpoints).
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import pretrain_ring_gpt_any_cp as script  # noqa: E402

KILL_RANK = int(os.environ.get("MEGATRON_RING_TEST_KILL_RANK", "-1"))
KILL_AT = int(os.environ.get("MEGATRON_RING_TEST_KILL_AT", "0"))
NOTE = os.environ.get("MEGATRON_RING_TEST_KILL_NOTE", "")


def _with_kill(forward_step):
    calls = 0

    @functools.wraps(forward_step)  # Megatron inspects the forward step's signature
    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if int(os.environ.get("RANK", "0")) == KILL_RANK and calls == KILL_AT:
            with open(NOTE, "w") as f:
                f.write(f"{time.time():.6f}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(*args, **kwargs)

    return wrapped


if __name__ == "__main__":
    script.base.forward_step = _with_kill(script.base.forward_step)
    script.main()
