"""CUDA-event timing for the GPU check scripts (tests/gpu/*_check.py): one place for the warm-up, the events
and the cross-rank maximum."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def timed_ms(step, dev, rounds: int = 6):
    """``step()`` ``rounds`` times between barriers; the median of all but the first (warm-up) in ms, the
    maximum over the ranks, and the last call's return value."""
    times, result = [], None
    for _ in range(rounds):
        torch.cuda.synchronize()
        dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        result = step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    t = torch.tensor([statistics.median(times[1:])], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(t.item(), 2), result
