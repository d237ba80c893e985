"""GPU benchmark row: the ring schedule's compute on one GPU vs one-GPU SDPA on the same problem.

Every rank's schedule (P = 2, 4, 8...) runs through :class:`~megatron_ring.transport.ring.LoopbackRing` on the one
GPU, one rank after another; the row reports the slowest rank's forward+backward time x P (what P GPUs
would spend in total) against torch SDPA on the whole sequence: the efficiency the engine leaves on the
table (block splitting, merges, kernel choice). No communication is timed. Needs CUDA.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ring.api import ring_attention
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring.schedules.layouts import get_layout

__all__ = ["gpu_row"]


def _time_ms(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_row(world: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            layout: str = "zigzag", causal: bool = True, iters: int = 10, kernel: str = "auto") -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("the GPU benchmark row needs CUDA")
    dev = torch.device("cuda")
    q = torch.randn(1, seq, heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seq, kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, seq, kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    lay = get_layout(layout)

    def sdpa():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, enable_gqa=True)
        out.sum().backward()

    per_rank = []
    for r in range(world):
        pos = lay.positions(seq, world, r).to(dev)
        leaves = [t[:, pos].detach().clone().requires_grad_() for t in (q, k, v)]
        ring = LoopbackRing(world, r, dev)

        def step(leaves=leaves, ring=ring):
            ring_attention(*leaves, causal=causal, layout=layout, ring=ring, kernel=kernel).sum().backward()

        per_rank.append(_time_ms(step, iters))
    one = _time_ms(sdpa, iters)
    return {"P": world, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "layout": layout, "causal": causal,
            "ring_slowest_rank_ms": max(per_rank), "ring_total_ms": max(per_rank) * world,
            "sdpa_one_gpu_ms": one, "efficiency": one / (max(per_rank) * world)}
