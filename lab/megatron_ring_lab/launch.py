"""Run a function on N local gloo processes (demo, benchmark and tests), never hanging.

The parent opens a TCPStore on 127.0.0.1 with an OS-chosen free port and spawns the workers, which
join it, initialise a gloo process group and call ``fn(rank, world_size, *args)``. Each return value
comes back through a file (tensors in multiprocessing queues are unreliable with spawned workers). The
parent waits at most ``timeout`` seconds, then kills every worker and raises; a worker's exception is
re-raised in the parent with its traceback.

Workers start from a fork server that has imported torch (and ``MEGATRON_RING_PRELOAD``, comma-separated
module names, e.g. ``megatron.core``) once, so a worker starts in milliseconds instead of importing torch
again for seconds; each worker gets the parent's environment as it is at launch. A caller whose ``env``
must be seen at process start by C libraries (glibc's ``MALLOC_*``: the benchmarks) gets fresh spawned
processes instead, and ``MEGATRON_RING_START_METHOD=spawn`` asks for them everywhere.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

from megatron_ring import settings

__all__ = ["run_on_ranks", "WorkerError"]


_READY_KEY = "megatron_ring/launch/ready"


class WorkerError(RuntimeError):
    """A worker raised, died or timed out."""


_PRELOAD = ["torch", "torch.distributed", "megatron_ring_lab.launch"]


def _context(env: dict[str, str] | None) -> Any:
    """The fork server (torch imported once) unless ``env`` must reach a fresh process (see the module doc)."""
    method = settings.start_method() or ("spawn" if env else "forkserver")
    if method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = settings.preload()
    ctx.set_forkserver_preload(_PRELOAD + extra)  # read when the server starts (first use), ignored after
    return ctx


def _worker(rank: int, world: int, port: int, outdir: str, threads: int, pg_timeout: float,
            fn: Callable[..., Any], args: tuple, environ: dict[str, str]) -> None:
    if os.environ != environ:  # a fork server's child: the server's environment, not the launcher's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        store.add(_READY_KEY, 1)  # started: the parent's `timeout` may count from here (startup_timeout)
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    if result[0] == "error":
        os._exit(1)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                 threads_per_rank: int = 1, pg_timeout: float | None = None,
                 env: dict[str, str] | None = None, return_exceptions: bool = False,
                 startup_timeout: float | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return their results.

    ``fn`` must be importable (a module-level function). Raises :class:`WorkerError` if any worker
    raises, exits abnormally or the whole run exceeds ``timeout`` seconds; with ``return_exceptions``
    the failed ranks' entries are WorkerError instances instead (for fault-injection tests).
    With ``startup_timeout``, the workers get that long to start and join the group, and ``timeout`` counts
    from then: a time bound on ``fn`` that process start-up on a loaded machine does not eat into.
    """
    import torch.distributed as dist

    ctx = _context(env)
    master = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                           timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    pg_timeout = pg_timeout if pg_timeout is not None else max(30.0, timeout - 10)
    with tempfile.TemporaryDirectory(prefix="megatron_ring_") as outdir:
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})  # also read at process start (e.g. glibc's MALLOC_* variables)
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, master.port, outdir, threads_per_rank, pg_timeout,
                                   fn, args, dict(os.environ)))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
        deadline = time.monotonic() + timeout
        if startup_timeout is not None:
            started_by = time.monotonic() + startup_timeout
            while (master.add(_READY_KEY, 0) < world_size and time.monotonic() < started_by
                   and all(p.is_alive() for p in procs)):
                time.sleep(0.05)
            deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pkl")
            status, value = "error", None
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
            if status == "ok":
                results.append(value)
                continue
            if r in alive:
                value = f"timed out after {timeout:.0f}s (killed)"
            elif value is None:
                value = f"exited with code {procs[r].exitcode} and no result"
            errors.append(f"[rank {r}] {value}")
            results.append(WorkerError(errors[-1]))
        if errors and not return_exceptions:
            raise WorkerError("\n".join(errors))
        return results
