"""Ours vs PyTorch's own context-parallel ring, side by side (``python -m megatron_ring_lab.benchmark --torch-ring``).

PyTorch's ring is the one ``torch.distributed.tensor.experimental.context_parallel`` dispatches SDPA to
(``_context_parallel/_attention.py``: ``_templated_ring_attention`` and its backward, K/V rotated by one
all-gather, dK/dV by all-to-all, the head-tail load balancer for causal masks, fp32 merge). Its
dispatcher maps only the CUDA SDPA ops, so on CPU it is called here directly, with the CPU flash op
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) and the same options the
dispatcher would set (load balancing on for causal, off otherwise): no DTensor wrapping, so PyTorch's
side pays less Python than through ``context_parallel``.

Both sides get the same shards of the same sequence (zigzag = PyTorch's head-tail order), fp32, one
thread per process, P gloo processes. Two PyTorch variants: ``torch (views)`` takes the BHSD views of
the ``[b, s, h, d]`` tensors a projection layer produces (what ours takes), ``torch (BHSD)`` contiguous
``[b, h, s, d]`` copies made beforehand (its best case: no ``contiguous()`` copies inside, the layout the
CPU kernel prefers). The modes take turns every iteration, order rotating; a time is the slowest rank's
forward+backward after a barrier; the ratio is the median over iterations of the within-iteration
ratio; the CPU ratio compares the busiest rank's process CPU seconds per call (all threads) the same
way, a measure the machine's other load stretches less than wall-clock time. Memory: each mode alone in fresh processes, peak resident memory per rank above the baseline
after a tiny warm-up (the main benchmark's method). Outputs of the two rings are compared once (they
must agree to fp32 rounding).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_ring.timing import timed
from megatron_ring_lab.bench.measure import BENCH_ENV, peak_mib, rss_mib

__all__ = ["run_torch_ring", "format_torch_ring", "MODES"]

MODES = ("ours", "torch (views)", "torch (BHSD)")


def _torch_ring_fn(group, causal: bool):
    """PyTorch's ring attention (forward and backward) over ``group`` as an autograd function of BHSD tensors."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten

    def balanced(fn):
        """``fn`` with the load-balance option context_parallel sets for these shards (head-tail if causal)."""
        def run(*args, **kw):
            old = cp._cp_options.enable_load_balance
            cp._cp_options.enable_load_balance = causal
            try:
                return fn(*args, **kw)
            finally:
                cp._cp_options.enable_load_balance = old
        return run

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = balanced(cp._templated_ring_attention)(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, causal)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return tuple(balanced(cp._templated_ring_attention_backward)(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, dout, "grad_out",
                q, k, v, out, lse, causal, dropout_p=0.0)[:3])

    return TorchRing.apply


def _inputs(cfg: dict[str, Any], rank: int, world: int):
    import torch

    from megatron_ring import shard_sequence

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, cfg["seq"], cfg["heads"], cfg["head_dim"], generator=g) for _ in range(4)]
    return [shard_sequence(t, dim=1, layout="zigzag").contiguous() for t in full]  # the default group's rank


def _calls(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_ring import ring_attention

    q, k, v, dout = _inputs(cfg, rank, world)
    torch_ring = _torch_ring_fn(dist.group.WORLD, cfg["causal"])
    leaves = {m: [t.clone().requires_grad_() for t in (q, k, v)] for m in MODES}
    bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    dout_bhsd = dout.transpose(1, 2).contiguous()

    def ours():
        ring_attention(*leaves["ours"], causal=cfg["causal"], layout="zigzag").backward(dout)

    def views():
        torch_ring(*(t.transpose(1, 2) for t in leaves["torch (views)"])).backward(dout.transpose(1, 2))

    def contiguous():
        torch_ring(*bhsd).backward(dout_bhsd)

    return {"ours": ours, "torch (views)": views, "torch (BHSD)": contiguous}


def _timing_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_ring import ring_attention

    calls = _calls(cfg, rank, world)
    for fn in calls.values():
        fn()  # warm-up
    # agreement: the two rings' outputs on these shards (fp32: within rounding of each other)
    q, k, v, _ = _inputs(cfg, rank, world)
    with torch.no_grad():
        a = ring_attention(q, k, v, causal=cfg["causal"], layout="zigzag")
        b = _torch_ring_fn(dist.group.WORLD, cfg["causal"])(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    diff = float((a - b).abs().max())
    names = list(calls)
    times: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    for it in range(cfg["iters"]):
        for m in names[it % len(names):] + names[:it % len(names)]:
            c0 = time.process_time()
            times[m] += timed(calls[m], 1, dist.barrier)
            cpu[m].append(time.process_time() - c0)
    return {"times": times, "cpu": cpu, "max_abs_diff": diff}


def _memory_worker(rank: int, world: int, cfg: dict[str, Any]) -> float:
    from megatron_ring_lab.bench.measure import warm_up
    import torch
    import torch.distributed as dist

    from megatron_ring import ring_attention

    torch_ring = _torch_ring_fn(dist.group.WORLD, cfg["causal"])
    if cfg["mode"] == "ours":
        warm_up(lambda *t: ring_attention(*t, causal=cfg["causal"], layout="zigzag"), 2 * world, torch.float32)
    else:
        warm_up(lambda *t: torch_ring(*(x.transpose(1, 2) for x in t)).transpose(1, 2), 2 * world, torch.float32)
    base = rss_mib()
    calls = _calls(cfg, rank, world)
    calls[cfg["mode"]]()
    calls[cfg["mode"]]()  # the second call holds the first one's gradients, as every training step does
    return peak_mib() - base


def run_torch_ring(world_sizes, seqs, causal_list=(True, False), heads: int = 8, head_dim: int = 64, iters: int = 5,
                   memory: bool = True, timeout: float = 1800.0) -> list[dict[str, Any]]:
    from megatron_ring_lab.launch import run_on_ranks

    rows = []
    for seq in seqs:
        for world in world_sizes:
            for causal in causal_list:
                cfg = dict(seq=seq, heads=heads, head_dim=head_dim, causal=causal, iters=iters)
                per_rank = run_on_ranks(_timing_worker, world, cfg, timeout=timeout, env=BENCH_ENV)
                slowest = {m: [max(t) for t in zip(*(r["times"][m] for r in per_rank))] for m in MODES}
                row = dict(seq=seq, P=world, causal=causal, iters=iters,
                           max_abs_diff=max(r["max_abs_diff"] for r in per_rank),
                           **{f"{m}_s": statistics.median(slowest[m]) for m in MODES})
                for m in MODES[1:]:
                    row[f"ours/{m}"] = statistics.median(a / b for a, b in zip(slowest["ours"], slowest[m]))
                # CPU seconds of the busiest rank's process (every thread: gloo's included): the work a call
                # costs, which the machine's other load does not stretch as it stretches wall-clock time
                busiest = {m: [max(t) for t in zip(*(r["cpu"][m] for r in per_rank))] for m in MODES}
                for m in MODES[1:]:
                    row[f"cpu ours/{m}"] = statistics.median(a / b for a, b in zip(busiest["ours"], busiest[m]))
                if memory:
                    for m in MODES:
                        row[f"{m}_mib"] = max(run_on_ranks(_memory_worker, world, dict(cfg, mode=m),
                                                           timeout=timeout, env=BENCH_ENV))
                rows.append(row)
                print(format_torch_ring([row], header=not rows[:-1]), flush=True)
    return rows


def format_torch_ring(rows: list[dict[str, Any]], header: bool = True) -> str:
    cols = [("seq", "S", "{}"), ("P", "P", "{}"), ("causal", "causal", "{}"), ("ours_s", "ours s", "{:.3f}"),
            ("torch (views)_s", "torch views s", "{:.3f}"), ("torch (BHSD)_s", "torch BHSD s", "{:.3f}"),
            ("ours/torch (views)", "ours/views", "{:.3f}"), ("ours/torch (BHSD)", "ours/BHSD", "{:.3f}"),
            ("cpu ours/torch (views)", "cpu o/views", "{:.3f}"), ("cpu ours/torch (BHSD)", "cpu o/BHSD", "{:.3f}"),
            ("ours_mib", "ours MiB", "{:.0f}"), ("torch (views)_mib", "views MiB", "{:.0f}"),
            ("torch (BHSD)_mib", "BHSD MiB", "{:.0f}"), ("max_abs_diff", "max|diff|", "{:.1e}")]
    lines = [" | ".join(f"{t:>9}" for _, t, _ in cols)] if header else []
    for r in rows:
        lines.append(" | ".join(f"{(f.format(r[k]) if r.get(k) is not None else '-'):>9}" for k, _, f in cols))
    return "\n".join(lines)
