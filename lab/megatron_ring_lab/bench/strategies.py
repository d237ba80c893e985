"""Benchmark of every comm type side by side (``python -m megatron_ring_lab.benchmark --comm-type ...``).

Per world size P, ONE set of P gloo processes (one thread each) times every requested comm type,
interleaved iteration by iteration, the order rotated each iteration (A B C, B C A, C A B, ...) so that
the noise of a shared machine and the state one type leaves for the next (allocator, caches) hit all of
them alike; a time is the slowest rank's forward+backward (after a barrier), the figure is
the median over ``--iters``. ``auto`` is timed like the others and its choice is reported, with its
time relative to the best measured type. Next to every measurement the cost model's prediction with
the machine numbers auto probed (agreed across ranks) is printed: ``pred/meas`` is the validation ratio
of docs/strategies.md.

With ``--memory`` each comm type also runs alone in fresh processes (one forward+backward) to measure
its peak resident memory per rank above the baseline (same method as the ring benchmark).
"""
from __future__ import annotations

import statistics
from typing import Any

from megatron_ring.timing import seconds
from megatron_ring_lab.bench.measure import rank_inputs

__all__ = ["run_comm_types", "print_rows"]


def _hier(world: int, inner: int):
    from megatron_ring.strategies import make_hierarchical_groups

    return make_hierarchical_groups(inner)


def _types_for(cfg: dict[str, Any], world: int) -> list[str]:
    from megatron_ring.planning.cost_model import candidate_types

    ok = candidate_types(cfg["heads"], world, _inner(world)) + ["auto"]
    return [t for t in cfg["comm_types"] if t in ok]


def _inner(world: int) -> int | None:
    return 2 if world >= 4 and world % 2 == 0 else None


def _timing_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_ring import ring_attention
    from megatron_ring.strategies import auto
    from megatron_ring.planning.cost_model import predict
    from megatron_ring.transport.groups import contexts

    inner = _inner(world)
    hier = _hier(world, inner) if inner else None
    q, k, v, dout = rank_inputs(cfg, rank, world)
    types = _types_for(cfg, world)
    kw = dict(causal=cfg["causal"], layout=cfg["layout"], comm_dtype=cfg["comm_dtype"], hierarchical_groups=hier)

    def step(ct):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ring_attention(*leaves, comm_type=ct, **kw).backward(dout)

    for ct in types:  # warm-up (and auto's probe and choice)
        if cfg.get("warmup", 1) or ct == "auto":
            step(ct)
    times: dict[str, list[float]] = {ct: [] for ct in types}
    for it in range(cfg["iters"]):
        for ct in types[it % len(types):] + types[:it % len(types)]:  # rotated: no type always follows another
            times[ct].append(seconds(lambda: step(ct), before=dist.barrier))
    res: dict[str, Any] = {"times": times}
    from megatron_ring.api import _ring_for
    from megatron_ring.wire.codecs import make_codec
    from megatron_ring.core.plan import RingPlan
    from megatron_ring.kernels.block import select_kernel
    from megatron_ring.schedules.layouts import get_layout

    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    plan = RingPlan(ring=_ring_for(dist.group.WORLD, q.device, None), layout=get_layout(cfg["layout"]),
                    causal=cfg["causal"], scale=1.0, kernel=select_kernel(qh), codec=make_codec(cfg["comm_dtype"], q.dtype))
    # collective on every rank; the same (cached) numbers auto used
    machine = auto.machine_for(plan, q.device, q.dtype, hier[1] if hier else None, qh.shape[1], qh.shape[3],
                               qh.shape[2])
    if rank == 0:
        pb = auto._problem(qh, kh, plan)
        res["choice"] = next((c for _, ctx in contexts() for c in ctx.choices.values()), None)
        res["auto_measured"] = auto.last_choice.get("measured") or {}
        res["auto_tie"] = auto.last_choice.get("tie")
        res["machine"] = vars(machine)
        preds = {ct: predict(ct, pb, world, machine, inner) for ct in types if ct != "auto"}
        res["predicted"] = {ct: p["time_s"] for ct, p in preds.items()}
        res["bytes"] = {ct: p["bytes_per_rank"] for ct, p in preds.items()}
    return res


def _memory_worker(rank: int, world: int, cfg: dict[str, Any], ct: str) -> float:
    from megatron_ring import ring_attention
    from megatron_ring_lab.bench.measure import peak_mib, rss_mib

    inner = _inner(world)
    hier = _hier(world, inner) if inner else None
    kw = dict(causal=cfg["causal"], layout=cfg["layout"], comm_dtype=cfg["comm_dtype"], hierarchical_groups=hier,
              comm_type="p2p" if ct == "auto" else ct)
    q, k, v, dout = rank_inputs(dict(cfg, seq=4 * world), rank, world)  # tiny warm-up: one-off state not counted
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ring_attention(*leaves, **kw).backward(dout)
    q, k, v, dout = rank_inputs(cfg, rank, world)
    base = rss_mib()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ring_attention(*leaves, **kw).backward(dout)
    return peak_mib() - base


def run_comm_types(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from megatron_ring_lab.bench.measure import BENCH_ENV
    from megatron_ring_lab.launch import run_on_ranks

    rows = []
    for world in cfg["world_sizes"]:
        per_rank = run_on_ranks(_timing_worker, world, cfg, timeout=cfg["timeout"], env=BENCH_ENV)
        r0 = per_rank[0]
        types = list(r0["times"])
        med = {ct: statistics.median(max(ts) for ts in zip(*(r["times"][ct] for r in per_rank))) for ct in types}
        measured = {ct: t for ct, t in med.items() if ct != "auto"}
        best = min(measured, key=measured.get) if measured else None
        row = {"P": world, "seq": cfg["seq"], "heads": cfg["heads"], "kv_heads": cfg["kv_heads"],
               "head_dim": cfg["head_dim"], "dtype": cfg["dtype"], "layout": cfg["layout"], "causal": cfg["causal"],
               "comm_dtype": cfg["comm_dtype"] or "none", "inner": _inner(world), "fwd_bwd_s": med,
               "iterations_s": {ct: [max(ts) for ts in zip(*(r["times"][ct] for r in per_rank))] for ct in types},
               "predicted_s": r0["predicted"], "model_bytes_per_rank": r0["bytes"], "best": best,
               "auto_choice": r0["choice"], "auto_measured_s": r0["auto_measured"], "auto_tie": r0["auto_tie"],
               "machine": r0["machine"]}
        if "auto" in med and best:
            row["auto_over_best"] = med["auto"] / med[best]
            if r0["choice"] in measured:  # the chosen type's own column: the same exchange, timed alongside
                row["choice_over_best"] = measured[r0["choice"]] / med[best]
        if cfg.get("memory"):
            row["peak_mib_per_rank"] = {
                ct: max(run_on_ranks(_memory_worker, world, cfg, ct, timeout=cfg["timeout"], env=BENCH_ENV))
                for ct in types if ct != "auto"}
        rows.append(row)
        print_rows([row])
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        head = (f"P={row['P']} S={row['seq']} h={row['heads']} h_kv={row['kv_heads']} d={row['head_dim']} "
                f"{row['dtype']} {row['layout']} causal={row['causal']} wire={row['comm_dtype']}"
                + (f" (a2a+p2p: {row['inner']}x{row['P'] // row['inner']})" if row["inner"] else ""))
        print(head, flush=True)
        print(f"  {'comm type':>10} | {'f+b s':>8} | {'pred s':>8} | {'pred/meas':>9} | {'model MB/rank':>13}"
              + (" | peak MiB/rank" if "peak_mib_per_rank" in row else ""))
        for ct, t in row["fwd_bwd_s"].items():
            p = row["predicted_s"].get(ct)
            b = row["model_bytes_per_rank"].get(ct)
            mem = row.get("peak_mib_per_rank", {}).get(ct)
            label = f"auto->{row['auto_choice']}" if ct == "auto" else ct
            print(f"  {label:>10} | {t:>8.3f} | {p if p is not None else float('nan'):>8.3f} | "
                  f"{(p / t) if p else float('nan'):>9.2f} | {(b or 0) / 1e6:>13.2f}"
                  + (f" | {mem:>8.0f}" if mem is not None else ""), flush=True)
        if "auto_over_best" in row:
            own = (f" (the {row['auto_choice']} column: {row['choice_over_best']:.3f} x best)"
                   if "choice_over_best" in row else "")
            print(f"  best measured: {row['best']}; auto chose {row['auto_choice']}: {row['auto_over_best']:.3f} x best"
                  + own, flush=True)
        if row.get("auto_measured_s"):
            print("  auto's near-tie measurement (fwd+bwd s, median of its rounds, once per signature): "
                  + ", ".join(f"{ct} {t:.3f}" for ct, t in row["auto_measured_s"].items())
                  + (f"; tie {row['auto_tie']:.1%}" if row.get("auto_tie") else ""), flush=True)
