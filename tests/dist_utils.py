"""Test-side access to the multi-process launcher (gloo on 127.0.0.1, free port, hard timeouts)."""
from megatron_ring.tools.launch import WorkerError, run_on_ranks


def run_distributed(fn, world_size, *args, timeout=300.0, **kwargs):
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; list of per-rank results."""
    return run_on_ranks(fn, world_size, *args, timeout=timeout, **kwargs)


__all__ = ["run_distributed", "WorkerError"]
