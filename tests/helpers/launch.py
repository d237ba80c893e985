"""Launching the suite's multi-process runs: gloo workers from the fork server, and torchrun jobs.

Every wait is bounded (``TIMEOUT_S``, env ``MEGATRON_RING_TEST_TIMEOUT``), ports are free ones, and a test that
starts processes is marked ``slow`` (tests/conftest.py checks it).
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from megatron_ring_lab import forkrun
from megatron_ring_lab.launch import WorkerError, run_on_ranks

ROOT = str(Path(__file__).resolve().parents[2])
#: what a job's ranks import before they fork (forkrun's PRELOAD), Megatron's checkpoint writer's results queue
#: from a forked Manager (tests/helpers/ckpt_queue.py) and megatron.training's flag help parsed once
#: (tests/helpers/arg_docstrings.py): the fork server's list (tests/conftest.py) and each job's, for a job that runs
#: without the server
CKPT_QUEUE = "tests.helpers.ckpt_queue"
JOB_PRELOAD = f"{forkrun.PRELOAD},{CKPT_QUEUE},tests.helpers.arg_docstrings"
#: the bound on one multi-process run or torchrun job (seconds)
TIMEOUT_S = float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "240"))


def run_distributed(fn, world_size, *args, timeout=300.0, **kwargs):
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (127.0.0.1, a free port, hard
    timeout); the list of per-rank results. ``WorkerError`` if a rank raised or the timeout passed."""
    return run_on_ranks(fn, world_size, *args, timeout=timeout, **kwargs)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now, BELOW the kernel's ephemeral range: a job's rank 0 binds its
    rendezvous store there a second or more later, and a port the OS hands out (any socket bound to port 0: gloo's
    listeners and connections of the other tests running beside it) can no longer take it in between. Before, the
    OS chose one from that range and a concurrent test's gloo socket took it now and then: rank 0 failed to bind, the
    others' store clients were reset by that socket (seen once in CI: a refusal test missed its message)."""
    lo = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 20000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: the OS's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc; elsewhere the IANA range's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152




def torchrun_cmd(script, nproc: int, *args: str) -> list[str]:
    """The command of a single-node job of ``nproc`` ranks on 127.0.0.1 and a free port. Without CUDA:
    ``lab/megatron_ring_lab/forkrun.py`` (torchrun's environment for each rank, the imports done once before the ranks
    fork: a job starts in seconds instead of every rank importing torch + Megatron); with CUDA (a forked rank
    could not use it): ``python -m torch.distributed.run``. Jobs that test torchrun itself (its teardown after a
    killed rank: tests/megatron/test_crash_resume.py; tests/test_fsdp2_ring.py) call torchrun directly."""
    import torch
    port = str(free_port())
    if torch.cuda.is_available():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                "127.0.0.1", "--master-port", port, str(script), *map(str, args)]
    return forkrun.command(nproc, script, *args, preload=JOB_PRELOAD)


def python_cmd(*args) -> list[str]:
    """``python ARGS`` (a script or ``-m MODULE``, then its arguments) for a test that runs a command-line tool
    (the doctor's CLI): forked from this session's fork server where there is one (``forkrun.py --exec``: the
    arguments, environment, streams, exit code and signals of a fresh interpreter, without importing torch again;
    a job the server would not give a fresh process's imports runs by itself), else a fresh interpreter. Not for a
    test of what a fresh interpreter imports: the server's process has torch and Megatron imported already."""
    return [sys.executable, *served(*args)]


def served(*job, preload: str = "") -> list[str]:
    """What follows the interpreter in :func:`python_cmd`, and what a launcher that adds the interpreter itself
    (torchrun's agent) runs per worker: ``forkrun.py --exec PRELOAD JOB`` where this session has a fork server
    (``preload``: imported first where the server refuses the job), else ``JOB``."""
    if os.environ.get(forkrun.SERVER_VARIABLE):
        return forkrun.command(forkrun.EXEC, *job, preload=preload)[1:]
    return list(map(str, job))


def torchrun_env(env: dict | None = None) -> dict:
    """The job's environment: this repository on PYTHONPATH, one thread per process, the rendezvous address
    (``forkrun.py`` reads MASTER_ADDR / MASTER_PORT from it; torchrun sets its own), ``env`` over them."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), **(env or {})}


def torchrun(script, nproc: int, *args: str, env: dict | None = None, timeout: float | None = None,
             name: str = "torchrun") -> subprocess.CompletedProcess:
    """A single-node job (``torchrun_cmd``), this repository on PYTHONPATH, one thread per process; asserts exit
    code 0 (the output's tail in the message)."""
    p = subprocess.run(torchrun_cmd(script, nproc, *args), env=torchrun_env(env), capture_output=True, text=True,
                       timeout=timeout or TIMEOUT_S)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def masked_mean_losses(log, micro_batches: int) -> list[float]:
    """Per-iteration masked mean loss from a ``MEGATRON_RING_LOSS_LOG`` file (one ``loss_sum tokens`` line
    per micro-batch, summed in float64 over DP x CP): sum of sums / sum of tokens per ``micro_batches`` lines."""
    rows = [tuple(map(float, line.split()[:2])) for line in Path(log).read_text().splitlines()]
    assert rows and len(rows) % micro_batches == 0, rows
    return [sum(r[0] for r in rows[i:i + micro_batches]) / sum(r[1] for r in rows[i:i + micro_batches])
            for i in range(0, len(rows), micro_batches)]


__all__ = ["ROOT", "TIMEOUT_S", "WorkerError", "free_port", "masked_mean_losses", "run_distributed", "torchrun",
           "torchrun_cmd", "torchrun_env"]
