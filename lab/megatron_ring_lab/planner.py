"""Planner CLI: predicted time, bytes and memory per rank of every comm type and layout, and the CP size
a sequence needs.

    python -m megatron_ring_lab.plan --seq-length 1048576 --hidden-size 8192 --num-attention-heads 64 \\
        --num-query-groups 8 --context-parallel-size 32 --gpus-per-node 8 \\
        --intra-node-bandwidth 450e9 --inter-node-bandwidth 50e9 --flops 700e12 \\
        [--micro-batch-size 1] [--gpu-memory 80e9 --num-layers 80] [--json plan.json]
    python -m megatron_ring_lab.plan --machine h100-sxm --seq-length 131072 --hidden-size 4096 \
        --num-attention-heads 32 --num-query-groups 8 --context-parallel-size 8 16 [--flops 450e12]
    python -m megatron_ring_lab.plan dynamic-cp --mix long-tail --world-sizes 8 64 ...   (per-document CP
        groups: fixed CP vs Megatron's hybrid-CP scheduler vs ours; see lab/megatron_ring_lab/dynamic_plan.py)

Times are per layer (attention only, forward + backward) from the cost model in
``megatron_ring/planning/cost_model.py`` (see docs/strategies.md for what it includes and how well it
matched measurements). ``--flops`` is the attention kernel's achieved rate per GPU (not the datasheet
peak), bandwidths are bytes/s per GPU. Memory per rank per layer is the seed's ``12 C d`` generalised to
GQA and the wire dtype, plus each strategy's transient workspace.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megatron_ring.schedules.layouts import LAYOUTS
from megatron_ring_lab.machines import MACHINES, machine as machine_preset
from megatron_ring.wire.codecs import COMM_DTYPE_ALIASES
from megatron_ring.planning.cost_model import (Machine, Problem, activation_bytes, candidate_types, pick, predict, smallest_cp, wire_bytes_per_elem)

__all__ = ["main", "plan"]

_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def _bytes(text: str) -> float:
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = text.strip().lower().removesuffix("b") if not text.strip().lower().endswith("ib") else text.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return float(t[: -len(u)]) * units[u]
    return float(t)


def plan(a: argparse.Namespace) -> dict[str, Any]:
    heads, groups = a.num_attention_heads, a.num_query_groups or a.num_attention_heads
    if a.hidden_size % heads or heads % groups:
        raise SystemExit("--hidden-size must divide by --num-attention-heads, and heads by --num-query-groups")
    d = a.kv_channels or a.hidden_size // heads
    elem = _ELEM[a.dtype]
    _apply_machine(a)
    machine = Machine(flops=a.flops, bwd_flops=a.bwd_flops, bw_intra=a.intra_node_bandwidth,
                      bw_inter=a.inter_node_bandwidth, latency=a.latency, gpus_per_node=a.gpus_per_node,
                      overlap=a.overlap)
    out: dict[str, Any] = {"inputs": vars(a), "rows": [], "recommendation": None}
    for cp in a.context_parallel_size:
        inner = a.a2a_size or (a.gpus_per_node if a.gpus_per_node and cp > a.gpus_per_node
                                and cp % a.gpus_per_node == 0 else None)
        for layout in a.layouts:
            need = LAYOUTS[layout].local_multiple() * cp
            if a.seq_length % need:
                continue
            pb = Problem(batch=a.micro_batch_size, seq=a.seq_length, heads=heads // a.tensor_model_parallel_size,
                         kv_heads=max(1, groups // a.tensor_model_parallel_size), head_dim=d, causal=a.causal,
                         layout=layout, elem_bytes=elem, wire_bytes=wire_bytes_per_elem(a.comm_dtype, elem, d),
                         kv_pieces=a.kv_pieces)
            for ct in candidate_types(pb.heads, cp, inner):
                r = predict(ct, pb, cp, machine, inner)
                r.update(cp=cp, layout=layout, inner=inner if ct == "a2a+p2p" else None,
                         memory_bytes=a.num_layers * r["activation_bytes"] + r["workspace_bytes"])
                out["rows"].append(r)
    if not out["rows"]:
        raise SystemExit("no (CP size, layout) divides --seq-length; pad the sequence")
    best = pick(out["rows"])
    out["recommendation"] = {k: best[k] for k in ("cp", "layout", "comm_type", "inner", "time_s")}
    if a.gpu_memory:
        pb = Problem(batch=a.micro_batch_size, seq=a.seq_length, heads=heads // a.tensor_model_parallel_size,
                     kv_heads=max(1, groups // a.tensor_model_parallel_size), head_dim=d, causal=a.causal,
                     layout=a.layouts[0], elem_bytes=elem, wire_bytes=wire_bytes_per_elem(a.comm_dtype, elem, d),
                         kv_pieces=a.kv_pieces)
        p = smallest_cp(pb, a.num_layers, a.gpu_memory, a.reserved_memory)
        out["cp_for_memory"] = {"gpu_memory": a.gpu_memory, "num_layers": a.num_layers, "reserved": a.reserved_memory,
                                "min_cp": p,
                                "per_rank_bytes": (a.num_layers * activation_bytes(pb, p) if p else None)}
    return out


def _apply_machine(a: argparse.Namespace) -> None:
    """Fill the machine numbers not given on the command line from ``--machine`` (:mod:`megatron_ring_lab.machines`);
    without a preset, the bandwidth and the kernel rate are required."""
    preset = None
    if a.machine:
        try:
            preset = machine_preset(a.machine)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    fill = {"intra_node_bandwidth": preset and preset.intra_node, "inter_node_bandwidth": preset and preset.inter_node,
            "flops": preset and preset.kernel_flops, "gpus_per_node": preset.gpus_per_node if preset else 8,
            "latency": preset.latency if preset else 20e-6}
    for key, val in fill.items():
        if getattr(a, key) is None:
            setattr(a, key, val)
    for key, flag in (("intra_node_bandwidth", "--intra-node-bandwidth"), ("flops", "--flops")):
        if getattr(a, key) is None:
            raise SystemExit(f"{flag} is required without --machine (presets: {', '.join(MACHINES)})")


def _print(res: dict[str, Any]) -> None:
    a = res["inputs"]
    print(f"# S={a['seq_length']} hidden={a['hidden_size']} heads={a['num_attention_heads']} "
          f"groups={a['num_query_groups'] or a['num_attention_heads']} mbs={a['micro_batch_size']} {a['dtype']} "
          f"wire={a['comm_dtype']} causal={a['causal']}; F={a['flops']:.3g} flop/s, B intra={a['intra_node_bandwidth']:.3g} "
          f"inter={a['inter_node_bandwidth'] or a['intra_node_bandwidth']:.3g} B/s, {a['gpus_per_node']} GPUs/node")
    head = f"{'CP':>5} | {'layout':>10} | {'comm type':>12} | {'fwd ms':>9} | {'bwd ms':>9} | {'f+b ms':>9} | " \
           f"{'GB sent/rank':>12} | {'act GB/layer':>12} | {'workspace GB':>12} | {'mem GB (x layers)':>17}"
    print(head)
    best = res["recommendation"]
    for r in sorted(res["rows"], key=lambda r: (r["cp"], r["layout"], r["time_s"])):
        ct = r["comm_type"] + (f" {r['inner']}x{r['cp'] // r['inner']}" if r["inner"] else "")
        mark = "  <= recommended" if (r["cp"], r["layout"], r["comm_type"]) == (best["cp"], best["layout"],
                                                                              best["comm_type"]) else ""
        print(f"{r['cp']:>5} | {r['layout']:>10} | {ct:>12} | {r['fwd_s'] * 1e3:>9.3f} | {r['bwd_s'] * 1e3:>9.3f} | "
              f"{r['time_s'] * 1e3:>9.3f} | {r['bytes_per_rank'] / 1e9:>12.3f} | {r['activation_bytes'] / 1e9:>12.3f} | "
              f"{r['workspace_bytes'] / 1e9:>12.3f} | {r['memory_bytes'] / 1e9:>17.3f}{mark}")
    print(f"recommendation: --context-parallel-size {best['cp']} --cp-layout {best['layout']} --cp-comm-type "
          f"{best['comm_type']}" + (f" --hierarchical-context-parallel-sizes {best['inner']} {best['cp'] // best['inner']}"
                                    if best["inner"] else "") + f"  ({best['time_s'] * 1e3:.3f} ms per layer, fwd+bwd)")
    m = res.get("cp_for_memory")
    if m:
        if m["min_cp"]:
            print(f"memory: {m['num_layers']} layers of attention activations fit in {m['gpu_memory'] / 1e9:.3g} GB "
                  f"(minus {m['reserved'] / 1e9:.3g} GB reserved) from --context-parallel-size {m['min_cp']} "
                  f"({m['per_rank_bytes'] / 1e9:.3f} GB per rank + workspace)")
        else:
            print("memory: no power-of-two CP size up to 4096 fits; reduce layers (pipeline parallelism) or "
                  "recompute activations")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dynamic-cp"]:  # per-document CP groups: lab/megatron_ring_lab/dynamic_plan.py
        from megatron_ring_lab.dynamic_plan import main as dynamic_main
        return dynamic_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m megatron_ring_lab.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-length", type=int, required=True)
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-attention-heads", type=int, required=True)
    ap.add_argument("--num-query-groups", type=int, default=None, help="K/V heads (GQA); default: = heads")
    ap.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden/heads")
    ap.add_argument("--context-parallel-size", type=int, nargs="+", required=True, help="one or more CP sizes")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--machine", default=None, help=f"GPU preset: {', '.join(MACHINES)} (link bandwidths, GPUs per "
                    "NVLink domain, latency and a default kernel rate from public spec sheets, see "
                    "lab/megatron_ring_lab/machines.py); flags given explicitly override its numbers")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node / NVLink domain (default 8)")
    ap.add_argument("--intra-node-bandwidth", type=float, default=None,
                    help="bytes/s per GPU inside a node (required without --machine)")
    ap.add_argument("--inter-node-bandwidth", type=float, default=None, help="bytes/s per GPU across nodes")
    ap.add_argument("--latency", type=float, default=None, help="seconds per message (default 20e-6)")
    ap.add_argument("--overlap", type=float, default=1.0,
                    help="fraction of a transfer hidden under compute (1: GPUs; 0: CPU processes)")
    ap.add_argument("--flops", type=float, default=None, help="achieved attention forward flop/s per GPU (the "
                    "kernel rate; required without --machine, whose default is 0.6 x its dense BF16 peak)")
    ap.add_argument("--bwd-flops", type=float, default=None, help="backward flop/s (default: --flops)")
    ap.add_argument("--a2a-size", type=int, default=None,
                    help="inner (a2a) size for a2a+p2p; default: --gpus-per-node when CP spans nodes")
    ap.add_argument("--layouts", nargs="+", default=["zigzag", "striped", "contiguous"], choices=sorted(LAYOUTS))
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dtype", choices=sorted(_ELEM), default="bf16")
    ap.add_argument("--comm-dtype", choices=list(COMM_DTYPE_ALIASES), default="none",
                    help="K/V wire dtype (any spelling ring_attention accepts)")
    ap.add_argument("--kv-pieces", type=int, default=1,
                    help="K/V pieces a ring step streams a block in (ring_attention's kv_pieces; 1: whole blocks)")
    ap.add_argument("--num-layers", type=int, default=1, help="layers held at once (memory answer)")
    ap.add_argument("--gpu-memory", type=_bytes, default=None,
                    help="bytes per GPU for attention activations (e.g. 80e9, 80GiB): prints the CP size needed")
    ap.add_argument("--reserved-memory", type=_bytes, default=0.0, help="bytes per GPU taken by other things")
    ap.add_argument("--json", help="write the result to this file")
    a = ap.parse_args(argv)
    res = plan(a)
    _print(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
