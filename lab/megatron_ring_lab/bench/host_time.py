"""The engine's own host time per ring step and per call (``python -m megatron_ring_lab.benchmark --host-time``).

What a GPU pays whenever blocks are small and the host cannot run ahead of the device: the Python, the
op dispatch and the small bookkeeping ops (merges, wire copies, status, gradient adds) of one
``ring_attention`` forward+backward, without the block kernels' own work.

How: one process, one thread, the loopback transport (:class:`~megatron_ring.transport.ring.LoopbackRing`:
the same schedule as P ranks, every exchange a local copy of a tiny block), and an INSTANT kernel
(:class:`InstantKernel`: returns results of the right shape made once per shape, so each kernel call costs
one Python call and nothing else). Per world size P a call is timed ``--iters`` times after a warm-up
(median of the thread's CPU time; the world sizes take turns). A call runs P forward steps and P backward steps, so the per-call time is fitted (least squares
over P = 2..8) as ``fixed + per_step * 2P``: ``per_step`` is the host time of one ring step, ``fixed`` what a
call costs on top of its steps (argument checks, plan and buffers, autograd).

This module imports only the library's public pieces (``ring_attention``, ``LoopbackRing``,
``BlockKernel``) and nothing of ``megatron_ring_lab``, so ``scripts/bench_revisions.py --host-time`` runs
this very file against an older revision of the library, side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from megatron_ring import ring_attention
from megatron_ring.kernels.block import BlockKernel
from megatron_ring.transport.ring import LoopbackRing

__all__ = ["InstantKernel", "host_times", "fit", "run_host_time", "format_host_time"]


class InstantKernel(BlockKernel):
    """A block kernel that does no work: each call returns tensors of the right shapes and dtypes, made
    once per shape (the engine only reads kernel results, it never writes into them)."""

    name = "instant"
    supports_mask = True

    def __init__(self) -> None:
        self._made: dict = {}

    def _once(self, key, make):
        got = self._made.get(key)
        if got is None:
            got = self._made[key] = make()
        return got

    def forward(self, q, k, v, causal, scale, **kw):
        b, h, s, _ = q.shape
        return self._once(("f", q.shape, v.shape[-1], q.dtype), lambda: (
            q.new_zeros((b, h, s, v.shape[-1])), q.new_zeros((b, h, s), dtype=torch.float32)))

    def backward(self, dout, q, k, v, out, lse, causal, scale, **kw):
        return self._once(("b", q.shape, k.shape, v.shape, q.dtype), lambda: (
            torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))


#: calls in a row per world size before the next one takes its turn
BURST = 10


def host_times(world_sizes, seq_local: int = 64, heads: int = 8, head_dim: int = 64, causal: bool = False,
               iters: int = 200, warmup: int = 20) -> dict[int, float]:
    """Median seconds of the calling thread's CPU time for one forward+backward ``ring_attention`` call, per
    world size (loopback ring, instant kernel, ``[1, seq_local, heads, head_dim]`` fp32 per rank, zigzag).

    CPU time of this thread, not wall-clock time: with one torch thread every op (the backward included)
    runs on this thread, and time the machine's other load takes from it is not counted. The world sizes
    take turns every :data:`BURST` calls, so what remains of a drifting load hits them alike."""
    torch.set_num_threads(1)
    calls = {}
    for world in world_sizes:
        ring, kernel = LoopbackRing(world, 0, torch.device("cpu")), InstantKernel()
        g = torch.Generator().manual_seed(world)
        q, k, v = (torch.randn(1, seq_local, heads, head_dim, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(1, seq_local, heads, head_dim, generator=g)

        def call(q=q, k=k, v=v, dout=dout, ring=ring, kernel=kernel):
            ring_attention(q, k, v, causal=causal, ring=ring, kernel=kernel, layout="zigzag").backward(dout)
            q.grad = k.grad = v.grad = None

        calls[world] = call
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[int, list[float]] = {w: [] for w in calls}
    clock = time.thread_time_ns
    for _ in range(max(1, iters // BURST)):
        for world, call in calls.items():
            call()  # a warm cache, as in a layer's steady state (not measured)
            for _ in range(BURST):
                t0 = clock()
                call()
                times[world].append((clock() - t0) * 1e-9)
    return {w: statistics.median(t) for w, t in times.items()}


def fit(times: dict[int, float]) -> tuple[float, float]:
    """``(per_step, fixed)`` seconds: least squares of ``time(P) = fixed + per_step * 2P``."""
    xs, ys = [2 * p for p in times], list(times.values())
    if len(xs) < 2:
        raise ValueError("the fit needs at least two world sizes")
    mx, my = statistics.mean(xs), statistics.mean(ys)
    per_step = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return per_step, my - per_step * mx


def run_host_time(world_sizes=(2, 3, 4, 5, 6, 7, 8), seq_local: int = 64, heads: int = 8, head_dim: int = 64,
                  iters: int = 200, causal_list=(False, True)) -> list[dict[str, Any]]:
    """One row per ``causal``: per-call medians per P and the fitted per-step and fixed host time."""
    rows = []
    for causal in causal_list:
        t = host_times(world_sizes, seq_local, heads, head_dim, causal, iters)
        per_step, fixed = fit(t)
        rows.append(dict(causal=causal, seq_local=seq_local, heads=heads, head_dim=head_dim,
                         call_s={str(p): v for p, v in t.items()}, per_step_s=per_step, fixed_s=fixed))
    return rows


def format_host_time(rows: list[dict[str, Any]]) -> str:
    ps = list(rows[0]["call_s"])
    lines = ["causal | " + " | ".join(f"P={p} ms" for p in ps) + " | per step ms | fixed/call ms"]
    for r in rows:
        lines.append(f"{r['causal']!s:>6} | " + " | ".join(f"{r['call_s'][p] * 1e3:6.3f}" for p in ps)
                     + f" | {r['per_step_s'] * 1e3:11.3f} | {r['fixed_s'] * 1e3:13.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(range(2, 9)))
    ap.add_argument("--seq-local", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line (RESULT ...)")
    a = ap.parse_args(argv)
    rows = run_host_time(a.world_sizes, a.seq_local, a.heads, a.head_dim, a.iters)
    print("RESULT " + json.dumps(rows) if a.json else format_host_time(rows), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
