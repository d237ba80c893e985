"""``benchmark --breakdown``: per ring step, where the time of one forward+backward goes.

Every rank runs the ring (one thread per process) with :func:`megatron_ring.breakdown.record` on, for
``--iters`` calls after a warm-up; per (phase, step, category) the median over calls of the mean over
ranks is reported, plus ``other`` (each rank's call time not inside a timed region -- Python, autograd,
allocation, result casts --, mean over ranks) and the slowest rank's ``wait``; the total is the slowest
rank's call. Categories: see :mod:`megatron_ring.breakdown`.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_ring.breakdown import CATEGORIES

__all__ = ["run_breakdown", "format_breakdown"]


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_ring import breakdown
    from megatron_ring import ring_attention
    from megatron_ring_lab.bench.measure import rank_inputs
    from megatron_ring.transport.ring import Ring

    q, k, v, dout = rank_inputs(cfg, rank, world, getattr(torch, cfg["dtype_name"]))
    ring = Ring(dist.group.WORLD, q.device)
    kw = dict(causal=cfg["causal"], layout=cfg["layout"], comm_dtype=cfg["comm_dtype"], ring=ring,
              kv_pieces=cfg.get("kv_pieces"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ring_attention(*leaves, **kw).backward(dout)  # warm-up
    calls = []
    for _ in range(cfg["iters"]):
        dist.barrier()
        with breakdown.record() as rec:
            t0 = time.perf_counter()
            ring_attention(*leaves, **kw).backward(dout)
            total = time.perf_counter() - t0
        calls.append({"total": total, "parts": {"|".join(map(str, key)): val for key, val in rec.items()}})
    return {"calls": calls}


def run_breakdown(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    from megatron_ring_lab.launch import run_on_ranks

    per_rank = run_on_ranks(_worker, world, cfg, timeout=cfg["timeout"],
                            env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    n = len(per_rank[0]["calls"])
    keys = sorted({k for r in per_rank for c in r["calls"] for k in c["parts"]},
                  key=lambda k: (k.split("|")[0] != "fwd", int(k.split("|")[1]), k.split("|")[2]))
    mean = {k: statistics.median(statistics.mean(r["calls"][i]["parts"].get(k, 0.0) for r in per_rank)
                                 for i in range(n)) for k in keys}
    slow_wait = {k: statistics.median(max(r["calls"][i]["parts"].get(k, 0.0) for r in per_rank)
                                      for i in range(n)) for k in keys if k.endswith("|wait")}
    total = statistics.median(max(r["calls"][i]["total"] for r in per_rank) for i in range(n))
    # each rank's own untimed rest (its call minus its timed regions): the slowest rank's total minus the
    # mean of the timed regions would also count how much later than the mean rank the slowest finished
    other = statistics.median(statistics.mean(c["total"] - sum(c["parts"].values())
                                              for c in (r["calls"][i] for r in per_rank)) for i in range(n))
    return {"P": world, "kv_pieces": cfg.get("kv_pieces") or "auto", "total_s": total, "mean": mean,
            "slowest_wait": slow_wait, "other_s": other}


def format_breakdown(res: dict[str, Any]) -> str:
    mean = res["mean"]
    steps = sorted({(k.split("|")[0], int(k.split("|")[1])) for k in mean}, key=lambda x: (x[0] != "fwd", x[1]))
    head = f"{'phase':>5} {'step':>4} | " + " | ".join(f"{c:>8}" for c in CATEGORIES) + f" | {'max wait':>8}"
    lines = [f"# P={res['P']}, kv_pieces={res.get('kv_pieces', 'auto')}: fwd+bwd {res['total_s']:.3f} s (slowest "
             "rank, median); seconds per step, mean over ranks (max wait: slowest rank)", head, "-" * len(head)]
    sums = {c: 0.0 for c in CATEGORIES}
    for phase, step in steps:
        vals = [mean.get(f"{phase}|{step}|{c}", 0.0) for c in CATEGORIES]
        for c, x in zip(CATEGORIES, vals):
            sums[c] += x
        mw = res["slowest_wait"].get(f"{phase}|{step}|wait", 0.0)
        lines.append(f"{phase:>5} {step:>4} | " + " | ".join(f"{x:8.4f}" for x in vals) + f" | {mw:8.4f}")
    other = res["other_s"]
    lines.append(f"{'sum':>10} | " + " | ".join(f"{sums[c]:8.4f}" for c in CATEGORIES)
                 + f" | other {other:.4f} s ({other / res['total_s']:.1%})")
    return "\n".join(lines)
