"""Dynamic-CP benchmark (``python -m megatron_ring_lab.benchmark --dynamic-cp``): one global batch of
documents at ``world`` CPU ranks (gloo, one thread each) under fixed CP=world, fixed CP=2 x DP=world/2,
Megatron's hybrid-CP policy and ours (:mod:`megatron_ring.planning.dynamic_cp`), measured side by side.

Per policy and iteration every rank runs the sub-samples the schedule gives it, in the schedule's order
(a barrier after each round): one ``ring_attention(..., group=<its subgroup>, qkv_format="thd",
cu_seqlens=...)`` forward + backward per sub-sample, causal, on random Q/K/V. Subgroups are made with
``torch.distributed.new_group`` on every rank (singletons included). Measured: the slowest rank's time
from a common barrier to its last sub-sample (median over iterations; the policies take turns each
iteration, rotating order, so drifting load hits them alike), and the measured imbalance = slowest
rank's time / the mean of the ranks' times.

Prediction: the same schedules' cost-model prediction with machine numbers probed at the start on these
ranks (attention rate and per-call overhead from single-rank calls, bandwidth and latency from pairwise
exchanges; agreed MIN/MAX over ranks; overlap 0: gloo copies share the cores). Also the model's
prediction for 8 and 64 GPUs (the UNSCALED lengths, :mod:`megatron_ring_lab.dynamic_plan` defaults).

Lengths are the named mix of :func:`megatron_ring_lab.dynamic_plan.doc_lengths` divided by
``--dynamic-scale`` (default 16: long-tail documents 32-256 tokens, long ones 2048-4096).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["run_dynamic_cp", "format_dynamic"]


def _probe(dist, torch, heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """This rank's attention rate / call overhead (P=1 calls) and pairwise bandwidth / latency."""
    from megatron_ring import ring_attention

    me = dist.new_group([dist.get_rank()])

    def call(s: int, reps: int = 3) -> float:
        q = torch.randn(s, heads, head_dim, requires_grad=True)
        k, v = (torch.randn(s, kv_heads, head_dim, requires_grad=True) for _ in range(2))
        cu = torch.tensor([0, s], dtype=torch.int32)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            ring_attention(q, k, v, group=me, qkv_format="thd", cu_seqlens=cu, causal=True).sum().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    tiny = call(16, 5)
    big_s = 1024
    big = call(big_s)
    overhead = tiny / 3  # one forward task and two backward ones
    area = big_s * (big_s + 1) / 2
    flops = area * 4 * heads * head_dim * 3.5 / max(1e-6, big - tiny)  # forward + 2.5x backward
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1 if (rank ^ 1) < world else rank

    def exchange(n: int, reps: int = 5) -> float:
        if peer == rank:
            return 0.0
        a, b = torch.zeros(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            ops = [dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    dist.barrier()
    lat = exchange(8)
    big_n = 8 << 20
    bw = big_n / max(1e-6, exchange(big_n) - lat) if peer != rank else 1e12
    return {"flops": flops, "call_overhead": overhead, "latency": lat, "bw": bw}


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_ring import ring_attention
    from megatron_ring.planning import dynamic_cp as dc
    from megatron_ring.planning.cost_model import Machine, Problem

    torch.set_num_threads(1)
    h, hk, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    p = _probe(dist, torch, h, hk, d)
    agreed = {}
    for k, op in (("flops", dist.ReduceOp.MIN), ("bw", dist.ReduceOp.MIN), ("latency", dist.ReduceOp.MAX),
                  ("call_overhead", dist.ReduceOp.MAX)):
        t = torch.tensor([p[k]], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        agreed[k] = float(t)
    m = Machine(flops=agreed["flops"], bw_intra=agreed["bw"], latency=agreed["latency"],
                call_overhead=agreed["call_overhead"], overlap=0.0)
    pb = Problem(batch=1, seq=0, heads=h, kv_heads=hk, head_dim=d, layout=cfg["layout"], elem_bytes=4)
    lens, cap = cfg["lengths"], cfg["cap"]
    cost = dc.PackCost(pb, m)
    scheds = {f"fixed CP={world}": dc.schedule_fixed_cp(lens, world, world, pb, m, max_tokens_per_rank=cap, cost=cost)}
    if world % 2 == 0 and world > 2:
        scheds[f"fixed CP=2 DP={world // 2}"] = dc.schedule_fixed_cp(lens, world, 2, pb, m, max_tokens_per_rank=cap,
                                                                     cost=cost)
    scheds["Megatron balanced"] = dc.schedule_megatron_balanced(lens, world, pb, m, max_tokens_per_rank=cap,
                                                                cost=cost)
    scheds["ours"] = dc.schedule_dynamic_cp(lens, world, pb, m, max_tokens_per_rank=cap, cost=cost)
    # every group any schedule uses, created on every rank in one order
    tuples = sorted({s.ranks for sch in scheds.values() for s in sch.subsamples}, key=lambda t: (len(t), t))
    groups = {t: dist.new_group(list(t)) for t in tuples}
    work = {}
    for name, sch in scheds.items():
        rounds = []
        for i, rnd in enumerate(sch.for_rank(rank)):
            calls = []
            for j, sub in enumerate(rnd):
                g = torch.Generator().manual_seed(1000 * i + j)
                s_local = sub.padded // sub.size
                q = torch.randn(s_local, h, d, generator=g).requires_grad_()
                k, v = (torch.randn(s_local, hk, d, generator=g).requires_grad_() for _ in range(2))
                calls.append((q, k, v, torch.randn(s_local, h, d, generator=g),
                              torch.tensor(sub.cu_seqlens, dtype=torch.int32), groups[sub.ranks]))
            rounds.append(calls)
        work[name] = rounds

    def run(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i, calls in enumerate(work[name]):
            for q, k, v, dout, cu, grp in calls:
                ring_attention(q, k, v, group=grp, qkv_format="thd", cu_seqlens=cu, causal=True,
                               layout=cfg["layout"]).backward(dout)
            if i < len(work[name]) - 1:
                dist.barrier()
        return time.perf_counter() - t0

    names = list(scheds)
    for name in names:  # warm-up: consistency checks, schedules
        run(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(cfg["iters"]):
        for name in names[it % len(names):] + names[:it % len(names)]:
            times[name].append(run(name))
    out = {"times": times, "machine": agreed}
    if rank == 0:
        out["pred"] = {n: {"step_s": s.step_s, "imbalance": s.imbalance, "rounds": len(s.rounds),
                           "calls": len(s.subsamples), "sizes": sorted({x.size for x in s.subsamples}),
                           "bytes_per_rank": max(s.bytes_per_rank()), "chosen": s.policy}
                       for n, s in scheds.items()}
    return out


def run_dynamic_cp(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg: world, mix, num_docs, seed, scale, heads, kv_heads, head_dim, layout, iters, timeout,
    gpu_worlds (model-only world sizes for the unscaled lengths)."""
    from megatron_ring.planning import dynamic_cp as dc
    from megatron_ring.planning.cost_model import Machine, Problem
    from megatron_ring_lab import dynamic_plan as dp
    from megatron_ring_lab.launch import run_on_ranks

    world = cfg["world"]
    full = dp.doc_lengths(cfg["mix"], cfg["num_docs"], cfg["seed"])
    lens = [max(1, n // cfg["scale"]) for n in full]
    # the cap: fixed CP=2 must hold the longest document (else it cannot run at all)
    cap = dc.padded_length(max(lens), 2, cfg["layout"]) // 2
    per_rank = run_on_ranks(_worker, world, dict(cfg, lengths=lens, cap=cap), timeout=cfg["timeout"])
    names = list(per_rank[0]["times"])
    rows = []
    for n in names:
        iters = len(per_rank[0]["times"][n])
        slowest = [max(r["times"][n][i] for r in per_rank) for i in range(iters)]
        imb = [max(r["times"][n][i] for r in per_rank) / statistics.mean(r["times"][n][i] for r in per_rank)
               for i in range(iters)]
        pred = per_rank[0]["pred"][n]
        rows.append(dict(policy=n, measured_s=statistics.median(slowest), measured_imbalance=statistics.median(imb),
                         **{f"pred_{k}" if k in ("step_s", "imbalance") else k: v for k, v in pred.items()}))
    gpu = {}
    pb = Problem(batch=1, seq=0, heads=32, kv_heads=8, head_dim=128, layout=cfg["layout"], elem_bytes=2)
    m = Machine(flops=400e12, bw_intra=300e9, bw_inter=50e9, gpus_per_node=8, latency=20e-6, call_overhead=20e-6)
    gcap = dc.padded_length(max(full), 2, cfg["layout"]) // 2
    for w in cfg.get("gpu_worlds", (8, 64)):
        gpu[w] = [{k: v for k, v in r.items() if k != "schedule"} for r in dp.compare(full, w, pb, m, gcap)]
    return {"rows": rows, "machine": per_rank[0]["machine"], "lengths": lens, "cap": cap, "gpu": gpu,
            "gpu_cap": gcap, "cfg": {k: v for k, v in cfg.items()}}


def format_dynamic(res: dict[str, Any]) -> str:
    c, mach = res["cfg"], res["machine"]
    lens = res["lengths"]
    out = [f"# dynamic CP: {len(lens)} documents ({c['mix']}, seed {c['seed']}, lengths / {c['scale']}: "
           f"{min(lens)}-{max(lens)} tokens, {sum(lens)} total), {c['world']} CPU ranks x 1 thread, "
           f"H={c['heads']} H_kv={c['kv_heads']} D={c['head_dim']} fp32 causal {c['layout']}, cap {res['cap']} "
           f"tokens/rank; median of {c['iters']} (slowest rank)",
           f"# probed: F={mach['flops']:.3g} flop/s, call {mach['call_overhead'] * 1e3:.2f} ms, "
           f"B={mach['bw']:.3g} B/s, latency {mach['latency'] * 1e6:.0f} us, overlap 0",
           f"{'policy':>22} | {'meas ms':>9} | {'meas imb':>8} | {'pred ms':>9} | {'pred imb':>8} | {'rounds':>6} | "
           f"{'calls':>5} | {'sizes':>8} | {'MB/rank':>8}"]
    for r in res["rows"]:
        out.append(f"{r['policy']:>22} | {r['measured_s'] * 1e3:>9.1f} | {r['measured_imbalance']:>8.3f} | "
                   f"{r['pred_step_s'] * 1e3:>9.1f} | {r['pred_imbalance']:>8.3f} | {r['rounds']:>6} | {r['calls']:>5} | "
                   f"{','.join(map(str, r['sizes'])):>8} | {r['bytes_per_rank'] / 1e6:>8.2f}"
                   + (f"  ({r['chosen']})" if r["chosen"].startswith("dynamic (=") else ""))
    from megatron_ring_lab.dynamic_plan import format_table

    for w, rows in res["gpu"].items():
        out.append(f"# model only, unscaled lengths, {w} GPUs (F=400e12, B=300e9/50e9, 8 per node, bf16 "
                   f"H=32 H_kv=8 D=128, cap {res['gpu_cap']} tokens/rank):")
        out.append(format_table(rows, w))
    return "\n".join(out)
