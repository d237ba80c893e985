"""The lab's launcher (``megatron_ring_lab.launch.run_on_ranks``): a caller's ``env`` that C libraries must see at process
start (the benchmarks' glibc ``MALLOC_*`` settings) reaches fresh spawned workers there, in their initial environment
(``/proc/self/environ``, what glibc reads). The suite itself runs benchmark launches from the fork server
(tests/conftest.py sets ``MEGATRON_RING_START_METHOD=forkserver``): this test asks for the default choice, and its
negative control shows the fork server's workers do not have the variable at start."""
from __future__ import annotations

import pytest

from megatron_ring_lab.launch import run_on_ranks

VARIABLE = "MEGATRON_RING_TEST_SEEN_AT_START"


def _seen_at_start(rank: int, world: int) -> tuple[bool, bool]:
    """(in this process's initial environment, in ``os.environ``)."""
    import os

    with open("/proc/self/environ", "rb") as f:
        initial = f.read().split(b"\0")
    return any(e.startswith(VARIABLE.encode() + b"=") for e in initial), VARIABLE in os.environ


@pytest.mark.slow  # starts processes
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/environ"), reason="needs /proc (Linux)")
def test_an_env_for_process_start_reaches_spawned_workers_at_start(monkeypatch):
    # negative control first: the fork server's workers (the server started, or already running, without the
    # variable) have it in os.environ, not in their initial environment
    monkeypatch.setenv("MEGATRON_RING_START_METHOD", "forkserver")
    assert run_on_ranks(_seen_at_start, 1, timeout=240) == [(False, False)]
    assert run_on_ranks(_seen_at_start, 1, env={VARIABLE: "1"}, timeout=240) == [(False, True)]
    monkeypatch.delenv("MEGATRON_RING_START_METHOD")  # the launcher's own choice for an env: spawned workers
    assert run_on_ranks(_seen_at_start, 1, env={VARIABLE: "1"}, timeout=240) == [(True, True)]
