"""Dynamic-CP planner: ``python -m megatron_ring_lab.plan dynamic-cp ...`` (see :func:`main`).

For a document-length distribution (a file of lengths, or a named synthetic mix) and one or more
DP x CP world sizes, it compares fixed CP sizes, Megatron's hybrid-CP policy and ours
(:mod:`megatron_ring.planning.dynamic_cp`) by the cost model: predicted step time (attention, one
layer, forward + backward, the slowest rank; rounds' barriers included), imbalance (slowest rank's time
over the mean busy time), bytes sent per rank, memory per rank (one layer x ``--num-layers``).

    python -m megatron_ring_lab.plan dynamic-cp --mix long-tail --num-docs 256 --world-sizes 8 64 \\
        --max-tokens-per-rank 32768 [--lengths-file lens.txt] [--flops 400e12 --bandwidth 300e9] [--json out.json]

Named mixes (:func:`doc_lengths`, seeded): ``long-tail`` (most documents 512-4096 tokens, one in 25 of
32768-65536) and ``uniform`` (512-65536 uniformly); ``--scale k`` divides every length by k.
"""
from __future__ import annotations

import argparse
import json
import random
from typing import Any

from megatron_ring.planning.cost_model import Machine, Problem
from megatron_ring.planning import dynamic_cp as dc

__all__ = ["doc_lengths", "MIXES", "compare", "format_table", "main"]

MIXES = ("long-tail", "uniform")
_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def doc_lengths(mix: str, n: int, seed: int = 0, scale: int = 1) -> list[int]:
    """``n`` seeded document lengths of a named mix, each divided by ``scale`` (at least 1 token).

    * ``long-tail``: ``max(1, round(n / 25))`` documents of 32768-65536 tokens, the rest 512-4096, in a
      seeded random order (the long ones are not at the front);
    * ``uniform``: every document 512-65536 tokens.
    """
    rnd = random.Random(seed)
    if mix == "long-tail":
        n_long = max(1, round(n / 25)) if n else 0
        lens = [rnd.randint(32768, 65536) for _ in range(n_long)] + [rnd.randint(512, 4096) for _ in range(n - n_long)]
        rnd.shuffle(lens)
    elif mix == "uniform":
        lens = [rnd.randint(512, 65536) for _ in range(n)]
    else:
        raise ValueError(f"unknown mix {mix!r}; choose one of {MIXES} or pass --lengths-file")
    return [max(1, x // scale) for x in lens]


def read_lengths(path: str) -> list[int]:
    """Lengths from a text file: integers separated by white space or commas ('#' starts a comment)."""
    out = []
    with open(path) as f:
        for line in f:
            out += [int(x) for x in line.split("#")[0].replace(",", " ").split()]
    if not out:
        raise ValueError(f"{path} holds no document lengths")
    return out


def _row(name: str, s: dc.DynamicCPSchedule, layers: int) -> dict[str, Any]:
    return {"policy": name, "step_s": s.step_s, "imbalance": s.imbalance, "rounds": len(s.rounds),
            "subsamples": len(s.subsamples), "sizes": sorted({x.size for x in s.subsamples}),
            "bytes_per_rank": max(s.bytes_per_rank(), default=0.0),
            "memory_bytes": layers * max(s.memory_per_rank(), default=0.0), "chosen": s.policy, "schedule": s}


def compare(lens: list[int], world: int, problem: Problem, machine: Machine, cap: int | None, *,
            layers: int = 1, seed: int = 0, comm_types=("p2p",)) -> list[dict[str, Any]]:
    """Rows for fixed CP (every size dividing ``world`` that holds the longest document), Megatron's
    policy (needs ``cap``), ours (any group size) and ours with power-of-two groups."""
    cost = dc.PackCost(problem, machine, comm_types)
    rows = []
    for cp in range(1, world + 1):
        if world % cp:
            continue
        try:
            rows.append(_row(f"fixed CP={cp} DP={world // cp}",
                             dc.schedule_fixed_cp(lens, world, cp, problem, machine, max_tokens_per_rank=cap,
                                                  cost=cost), layers))
        except ValueError:
            continue
    if cap is not None:
        rows.append(_row("Megatron balanced", dc.schedule_megatron_balanced(
            lens, world, problem, machine, max_tokens_per_rank=cap, cost=cost), layers))
    rows.append(_row("ours (pow2 groups)", dc.schedule_dynamic_cp(
        lens, world, problem, machine, max_tokens_per_rank=cap, sizes="pow2", seed=seed, cost=cost), layers))
    rows.append(_row("ours", dc.schedule_dynamic_cp(
        lens, world, problem, machine, max_tokens_per_rank=cap, seed=seed, cost=cost), layers))
    return rows


def format_table(rows: list[dict[str, Any]], world: int, extra: dict[str, str] | None = None) -> str:
    extra = extra or {}
    cols = f"{'world':>5} | {'policy':>20} | {'pred ms':>9} | {'imbal':>6} | {'rounds':>6} | {'calls':>5} | " \
           f"{'group sizes':>18} | {'MB sent/rank':>12} | {'mem MB/rank':>11}" + \
           "".join(f" | {k:>{max(9, len(k))}}" for k in extra)
    lines = [cols]
    base = next((r["step_s"] for r in rows if r["policy"].startswith("fixed CP=")
                 and r["policy"].endswith(" DP=1")), None)
    for r in rows:
        sizes = ",".join(map(str, r["sizes"]))
        line = (f"{world:>5} | {r['policy']:>20} | {r['step_s'] * 1e3:>9.3f} | {r['imbalance']:>6.3f} | "
                f"{r['rounds']:>6} | {r['subsamples']:>5} | {sizes:>18} | {r['bytes_per_rank'] / 1e6:>12.2f} | "
                f"{r['memory_bytes'] / 1e6:>11.1f}")
        for k, key in extra.items():
            v = r.get(key)
            line += f" | {('-' if v is None else f'{v:.3f}'):>{max(9, len(k))}}"
        if str(r.get("chosen", "")).startswith("dynamic (="):  # a baseline was predicted best: say which
            line += f"  (= {r['chosen'][len('dynamic (= '):-1]})"
        lines.append(line)
    if base:
        ours = next(r for r in rows if r["policy"] == "ours")
        lines.append(f"      ours vs fixed CP={world}: {base / ours['step_s']:.2f}x predicted")
    return "\n".join(lines)


def machine_from(a: argparse.Namespace) -> Machine:
    return Machine(flops=a.flops, bwd_flops=a.bwd_flops, bw_intra=a.bandwidth, bw_inter=a.inter_node_bandwidth,
                   latency=a.latency, gpus_per_node=a.gpus_per_node, call_overhead=a.call_overhead, overlap=a.overlap)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--heads", type=int, default=32, help="attention heads (per tensor-parallel rank)")
    ap.add_argument("--kv-heads", type=int, default=8, help="K/V heads (GQA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(_ELEM), default="bf16")
    ap.add_argument("--layout", choices=["zigzag", "striped", "contiguous"], default="zigzag")


def problem_from(a: argparse.Namespace) -> Problem:
    return Problem(batch=1, seq=0, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, causal=True,
                   layout=a.layout, elem_bytes=_ELEM[a.dtype])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m megatron_ring_lab.plan dynamic-cp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", choices=MIXES, default="long-tail")
    ap.add_argument("--lengths-file", help="document lengths (overrides --mix)")
    ap.add_argument("--num-docs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=1, help="divide every mix length by this")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64], help="DP x CP ranks")
    ap.add_argument("--max-tokens-per-rank", type=int, default=32768,
                    help="memory cap per rank per sub-sample (Megatron's --max-seqlen-per-dp-cp-rank); 0: none")
    ap.add_argument("--num-layers", type=int, default=1, help="memory column: layers held at once")
    add_shape_args(ap)
    ap.add_argument("--flops", type=float, default=400e12, help="achieved attention forward flop/s per GPU")
    ap.add_argument("--bwd-flops", type=float, default=None)
    ap.add_argument("--bandwidth", type=float, default=300e9, help="bytes/s per GPU inside a node")
    ap.add_argument("--inter-node-bandwidth", type=float, default=50e9)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--latency", type=float, default=20e-6)
    ap.add_argument("--call-overhead", type=float, default=20e-6, help="seconds per kernel call")
    ap.add_argument("--overlap", type=float, default=1.0)
    ap.add_argument("--json", help="write the rows (without the schedules) to this file")
    a = ap.parse_args(argv)
    lens = read_lengths(a.lengths_file) if a.lengths_file else doc_lengths(a.mix, a.num_docs, a.seed, a.scale)
    pb, m = problem_from(a), machine_from(a)
    cap = a.max_tokens_per_rank or None
    src = a.lengths_file or f"mix={a.mix} n={a.num_docs} seed={a.seed} scale={a.scale}"
    print(f"# {src}: {len(lens)} documents, {sum(lens)} tokens, longest {max(lens)}; heads={a.heads} "
          f"kv={a.kv_heads} d={a.head_dim} {a.dtype} {a.layout}; cap {cap} tokens/rank; F={a.flops:.3g} "
          f"B={a.bandwidth:.3g}/{a.inter_node_bandwidth:.3g} B/s, {a.gpus_per_node}/node; one layer's attention "
          f"fwd+bwd, predicted", flush=True)
    out = []
    for world in a.world_sizes:
        rows = compare(lens, world, pb, m, cap, layers=a.num_layers, seed=a.seed)
        print(format_table(rows, world), flush=True)
        out += [dict({k: v for k, v in r.items() if k != "schedule"}, world=world) for r in rows]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out
