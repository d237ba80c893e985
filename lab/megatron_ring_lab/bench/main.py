"""Benchmark CLI: ring attention vs one-process SDPA, side by side in one run.

    python -m megatron_ring_lab.benchmark --world-sizes 1 2 4 --seq 8192 --heads 8 --head-dim 64 \
        --causal --layout zigzag [--comm-dtype none bf16 fp8] [--json out.json] [--plot out.png]
    python -m megatron_ring_lab.benchmark --dynamic-cp [long-tail|uniform] --world-sizes 4 --heads 4 --kv-heads 2
        (per-document CP groups: fixed CP vs Megatron's hybrid-CP scheduler vs ours, measured and predicted)

For every world size P (and wire dtype) it spawns P gloo processes with one thread each and times, per
iteration, the slowest rank (after a barrier): the forward, and forward+backward, of

* ``ring``: ring attention over the P processes;
* ``compute-only``: the identical schedule with every exchange replaced by a local copy (same processes),
  so ``overlap overhead = ring / compute-only - 1`` is the cost of communication that was not hidden;
* ``split`` (when P divides the head counts): each rank runs one-thread SDPA over ``H / P`` heads of the
  WHOLE sequence, side by side -- the work split P ways with no communication and nothing redundant, on
  the same processes and cores as the ring, so it also pays what running P processes together costs the
  machine (shared caches, memory bandwidth, oversubscribed cores). ``split eff = split / ring`` is the
  ring's parallel efficiency against that ideal (1.0: the ring costs nothing over the ideal split);

the modes take turns every iteration (rotating order), and the ratios ``overlap overhead`` and ``split
eff`` are medians over iterations of the ratio within each iteration, so a load that drifts during a
run moves both sides alike;

and in one process with P threads, torch's ``scaled_dot_product_attention`` on the full sequence
(``single``). ``efficiency = single / ring`` (1.0: perfect scaling). The compute limit is measured too:
``T1`` is the same one-process SDPA with ONE thread, ``limit = T1 / min(P, cores)`` (P ranks cannot run
faster than the work split over the cores they share), and ``ring / limit`` is how far the ring is from
it (1.0: no overhead at all; ``limit eff = limit / ring``). Memory is the peak resident memory
per process above its baseline after a tiny warm-up call (so the fixed cost of starting autograd, thread
pools and the like is left out), with glibc told to return freed blocks at once; ``mem ratio`` is
``ring per rank / (single / P)`` (1.0: memory splits perfectly). ``--head-chunks`` is the deprecated alias of
``--kv-pieces`` (``ring_attention(head_chunks=n)`` runs as ``kv_pieces=n``). Bytes are the K/V (and dK/dV) buffers
each rank sends per call. Times are medians over ``--iters``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from typing import Any

from megatron_ring.strategies import COMM_TYPES
from megatron_ring.timing import timed
from megatron_ring.wire.codecs import COMM_DTYPE_ALIASES
from megatron_ring_lab.bench.measure import BENCH_ENV, DTYPES, peak_mib, rss_mib, rank_inputs, warm_up

__all__ = ["main"]




def _ring_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_ring import ring_attention
    from megatron_ring.transport.ring import LoopbackRing, Ring

    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    warm_up(lambda *t: ring_attention(*t, causal=cfg["causal"], layout=cfg["layout"]), 2 * world, dtype)
    base = rss_mib()
    g = torch.Generator().manual_seed(rank)  # also draws the split rows' inputs below
    q, k, v, dout = rank_inputs(cfg, rank, world, dtype, g)
    modes: dict[str, tuple[Any, Any]] = {}  # mode -> (fwd, fwd_bwd)
    results: dict[str, Any] = {}
    rings = {"ring": Ring(dist.group.WORLD, q.device)}
    if world > 1:
        rings["compute-only"] = LoopbackRing(world, rank, q.device)
    for mode, ring in rings.items():
        kw = dict(causal=cfg["causal"], layout=cfg["layout"], comm_dtype=cfg["comm_dtype"], ring=ring,
                  head_chunks=cfg["head_chunks"], kv_pieces=cfg.get("kv_pieces"))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        modes[mode] = (lambda kw=kw: _no_grad(ring_attention, q, k, v, **kw),
                       lambda kw=kw, leaves=leaves: ring_attention(*leaves, **kw).backward(dout))
        modes[mode][1]()  # warm-up (also runs the one-off consistency check)
        if mode == "ring":  # the ring's own peak, before the other modes' tensors exist; the second call
            modes[mode][1]()  # holds the first one's gradients, as every later call (and training step) does
            results["peak_mib"] = peak_mib() - base
    if world > 1 and cfg["heads"] % world == 0 and cfg["kv_heads"] % world == 0:
        modes["split"] = _sdpa_calls(cfg, dtype, g, share=world)
        modes["split"][1]()
    before = dict(rings["ring"].bytes_sent)
    times = _interleaved(modes, cfg["iters"], dist.barrier)
    sent = {ch: n_bytes - before.get(ch, 0) for ch, n_bytes in rings["ring"].bytes_sent.items()}
    n = cfg["iters"]
    for mode in modes:
        results[mode] = {"fwd": times[mode, 0], "fwd_bwd": times[mode, 1]}
    results["ring"].update(bytes_fwd=sent.get("fwd_kv", 0) / (2 * n),  # fwd ran in both loops
                           bytes_bwd=(sent.get("bwd_kv", 0) + sent.get("bwd_dkv", 0)) / n)
    return results


def _no_grad(fn, *args, **kwargs) -> None:
    import torch

    with torch.no_grad():
        fn(*args, **kwargs)


def _sdpa_calls(cfg: dict[str, Any], dtype, g, share: int = 1) -> tuple[Any, Any]:
    """``(fwd, fwd_bwd)`` of torch SDPA over ``H / share`` heads of the WHOLE sequence, on the ring's
    memory layout (``[b, s, h, d]``; Megatron's sbhd is strided the same way) seen as BHSD: the same
    layout on both sides (contiguous BHSD inputs make this SDPA 3-7% faster on CPU, measured).

    ``share = P`` is one rank's share of a head-parallel split: no communication and no redundant work,
    so P ranks running it side by side is the best any split of the problem can do on these cores (the
    cores' sharing costs included)."""
    import torch
    import torch.nn.functional as F

    mk = lambda h: torch.randn(cfg["batch"], cfg["seq"], h // share, cfg["head_dim"],  # noqa: E731
                               generator=g).to(dtype).transpose(1, 2)
    q, k, v = mk(cfg["heads"]), mk(cfg["kv_heads"]), mk(cfg["kv_heads"])
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(is_causal=cfg["causal"], enable_gqa=cfg["heads"] != cfg["kv_heads"])
    return (lambda: _no_grad(F.scaled_dot_product_attention, q, k, v, **kw),
            lambda: F.scaled_dot_product_attention(*leaves, **kw).backward(dout))


def _interleaved(modes: dict[str, tuple[Any, Any]], iters: int, sync) -> dict[tuple[str, int], list[float]]:
    """Per iteration every mode's forward, then every mode's forward+backward, in an order that rotates
    each iteration, each after ``sync()``: the modes see the same machine (its load drifts over a run)."""
    names = list(modes)
    times: dict[tuple[str, int], list[float]] = {(m, i): [] for m in names for i in (0, 1)}
    for it in range(iters):
        order = names[it % len(names):] + names[:it % len(names)]
        for i in (0, 1):
            for m in order:
                times[m, i] += timed(modes[m][i], 1, sync)
    return times


def _single_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    warm_up(lambda *t: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t), is_causal=cfg["causal"]),
             2, dtype)
    base = rss_mib()
    fwd, fwd_bwd = _sdpa_calls(cfg, dtype, torch.Generator().manual_seed(0))
    fwd_bwd()
    return {"fwd": timed(fwd, cfg["iters"]), "fwd_bwd": timed(fwd_bwd, cfg["iters"]),
            "peak_mib": peak_mib() - base}


def _slowest_rank_medians(per_rank: list[dict[str, Any]], mode: str, key: str) -> float:
    """Median over iterations of the slowest rank's time."""
    iters = zip(*(r[mode][key] for r in per_rank))
    return statistics.median(max(t) for t in iters)


def _median_ratio(per_rank: list[dict[str, Any]], num: str, den: str, key: str = "fwd_bwd") -> float:
    """Median over iterations of (slowest rank's ``num`` time) / (slowest rank's ``den`` time), each
    iteration's pair measured back to back."""
    slowest = lambda mode: [max(t) for t in zip(*(r[mode][key] for r in per_rank))]  # noqa: E731
    return statistics.median(a / b for a, b in zip(slowest(num), slowest(den)))


def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """All benchmark rows for ``cfg`` (see ``main`` for the keys)."""
    from megatron_ring.wire.codecs import KVSpec, make_codec
    from megatron_ring_lab.launch import run_on_ranks
    import torch

    rows = []
    t1 = None  # one process, ONE thread: the compute limit's numerator (measured once per run)
    if cfg.get("limit", True):
        t1 = statistics.median(run_on_ranks(_single_worker, 1, cfg, threads_per_rank=1, timeout=cfg["timeout"],
                                            env=BENCH_ENV)[0]["fwd_bwd"])
    for world in cfg["world_sizes"]:
        single = run_on_ranks(_single_worker, 1, cfg, threads_per_rank=world, timeout=cfg["timeout"], env=BENCH_ENV)[0]
        for comm, chunks, pieces in itertools.product(cfg["comm_dtypes"], cfg["head_chunks_list"],
                                                      cfg.get("kv_pieces_list", [None])):
            c = dict(cfg, comm_dtype=None if comm == "none" else comm, head_chunks=chunks, kv_pieces=pieces)
            per_rank = run_on_ranks(_ring_worker, world, c, timeout=cfg["timeout"], env=BENCH_ENV)
            s = cfg["seq"] // world
            dtype = getattr(torch, DTYPES[cfg["dtype"]])
            kshape = (cfg["batch"], cfg["kv_heads"], s, cfg["head_dim"])
            step_bytes = make_codec(c["comm_dtype"], dtype).wire_bytes(KVSpec(kshape, kshape, dtype, torch.device("cpu")))
            step_bytes //= min(chunks, cfg["kv_heads"])  # per (smaller) step when heads are chunked
            row = {
                "P": world, "seq": cfg["seq"], "heads": cfg["heads"], "kv_heads": cfg["kv_heads"],
                "head_dim": cfg["head_dim"], "dtype": cfg["dtype"], "layout": cfg["layout"],
                "causal": cfg["causal"], "comm_dtype": comm, "head_chunks": chunks,
                "kv_pieces": "auto" if pieces is None else pieces,
                "ring_fwd_s": _slowest_rank_medians(per_rank, "ring", "fwd"),
                "ring_fwd_bwd_s": _slowest_rank_medians(per_rank, "ring", "fwd_bwd"),
                "single_fwd_s": statistics.median(single["fwd"]),
                "single_fwd_bwd_s": statistics.median(single["fwd_bwd"]),
                "ring_peak_mib_per_rank": max(r["peak_mib"] for r in per_rank),
                "single_peak_mib": single["peak_mib"],
                "kv_bytes_per_step": step_bytes if world > 1 else 0,
                "bytes_fwd_per_rank": per_rank[0]["ring"]["bytes_fwd"],
                "bytes_bwd_per_rank": per_rank[0]["ring"]["bytes_bwd"],
            }
            row["efficiency_fwd_bwd"] = row["single_fwd_bwd_s"] / row["ring_fwd_bwd_s"]
            row["mem_ratio"] = row["ring_peak_mib_per_rank"] / (row["single_peak_mib"] / world)
            row["ring_over_single_fwd_bwd"] = row["ring_fwd_bwd_s"] / row["single_fwd_bwd_s"]
            if t1 is not None:
                cores = min(world, os.cpu_count() or 1)
                row.update(single_1thread_fwd_bwd_s=t1, cores=cores, limit_fwd_bwd_s=t1 / cores)
                row["ring_over_limit"] = row["ring_fwd_bwd_s"] / row["limit_fwd_bwd_s"]
            if world > 1:
                row["compute_only_fwd_s"] = _slowest_rank_medians(per_rank, "compute-only", "fwd")
                row["compute_only_fwd_bwd_s"] = _slowest_rank_medians(per_rank, "compute-only", "fwd_bwd")
                row["overlap_overhead_fwd"] = _median_ratio(per_rank, "ring", "compute-only", "fwd") - 1
                row["overlap_overhead_fwd_bwd"] = _median_ratio(per_rank, "ring", "compute-only") - 1
            if "split" in per_rank[0]:
                row["split_fwd_bwd_s"] = _slowest_rank_medians(per_rank, "split", "fwd_bwd")
                row["split_efficiency"] = _median_ratio(per_rank, "split", "ring")
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows



_COLUMNS = [("P", "P", "{}"), ("comm_dtype", "wire", "{}"), ("head_chunks", "chunks", "{}"), ("kv_pieces", "pieces", "{}"),
            ("ring_fwd_s", "ring fwd s", "{:.3f}"),
            ("ring_fwd_bwd_s", "ring f+b s", "{:.3f}"), ("single_fwd_bwd_s", "1proc f+b s", "{:.3f}"),
            ("efficiency_fwd_bwd", "efficiency", "{:.2f}"), ("single_1thread_fwd_bwd_s", "T1 f+b s", "{:.3f}"),
            ("limit_fwd_bwd_s", "limit s", "{:.3f}"), ("ring_over_limit", "ring/limit", "{:.3f}"),
            ("compute_only_fwd_bwd_s", "comp-only f+b s", "{:.3f}"),
            ("overlap_overhead_fwd_bwd", "overlap ovh", "{:+.1%}"),
            ("split_fwd_bwd_s", "split f+b s", "{:.3f}"), ("split_efficiency", "split eff", "{:.3f}"),
            ("ring_peak_mib_per_rank", "ring MiB/rank", "{:.0f}"),
            ("single_peak_mib", "1proc MiB", "{:.0f}"), ("mem_ratio", "mem ratio", "{:.2f}"),
            ("kv_bytes_per_step", "KV B/step", "{:,}"),
            ("bytes_fwd_per_rank", "fwd B/rank", "{:,.0f}"), ("bytes_bwd_per_rank", "bwd B/rank", "{:,.0f}")]


def _format_row(row: dict[str, Any]) -> str:
    cells = []
    for key, title, fmt in _COLUMNS:
        val = row.get(key)
        cells.append(f"{fmt.format(val) if val is not None else '-':>{max(len(title), 6)}}")
    return " | ".join(cells)


def _header() -> str:
    return " | ".join(f"{title:>{max(len(title), 6)}}" for _, title, _ in _COLUMNS)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """PNG: fwd+bwd time and peak memory per rank against P (one line per wire dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    variant = lambda r: (r["comm_dtype"], r["head_chunks"], str(r.get("kv_pieces", "auto")))  # noqa: E731
    for comm, chunks, pieces in sorted({variant(r) for r in rows}):
        sub = [r for r in rows if variant(r) == (comm, chunks, pieces)]
        ps = [r["P"] for r in sub]
        label = (f"ring (wire {comm}" + (f", {chunks} head chunks" if chunks > 1 else "")
                 + (f", {pieces} pieces)" if pieces != "auto" else ")"))
        ax_t.plot(ps, [r["ring_fwd_bwd_s"] for r in sub], "o-", label=label)
        ax_m.plot(ps, [r["ring_peak_mib_per_rank"] for r in sub], "o-", label=label)
    first = [r for r in rows if variant(r) == variant(rows[0])]
    ax_t.plot([r["P"] for r in first], [r["single_fwd_bwd_s"] for r in first], "s--", label="1 process, P threads")
    ax_m.plot([r["P"] for r in first], [r["single_peak_mib"] for r in first], "s--", label="1 process")
    r0 = rows[0]
    title = f"S={r0['seq']} H={r0['heads']} D={r0['head_dim']} {r0['dtype']} {r0['layout']}{' causal' if r0['causal'] else ''}"
    for ax, ylab in ((ax_t, "forward+backward time (s, median)"), (ax_m, "peak memory per rank (MiB)")):
        ax.set_xlabel("P (ranks)")
        ax.set_ylabel(ylab)
        ax.set_xticks(sorted({r["P"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m megatron_ring_lab.benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=8192, help="global sequence length S")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default = --heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--v-head-dim", type=int, default=None,
                    help="--gpu-row: V's head dim where it differs from Q/K's (MLA, e.g. --head-dim 192 --v-head-dim "
                         "128; dense rows only)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--layout", choices=["zigzag", "striped", "contiguous"], default=None,
                    help="default zigzag (--plan-time: striped)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--comm-dtype", nargs="+", default=["none"], choices=list(COMM_DTYPE_ALIASES),
                    help="wire dtype(s) for K/V (any spelling ring_attention accepts)")
    ap.add_argument("--head-chunks", type=int, nargs="+", default=[1],
                    help="deprecated alias of --kv-pieces: ring_attention(head_chunks=n) runs as kv_pieces=n (one row per value)")
    ap.add_argument("--kv-pieces", nargs="+", default=["auto"],
                    help="K/V pieces per ring step (sub-block streaming; 'auto' = the default; one row per value)")
    ap.add_argument("--comm-type", nargs="+", default=None,
                    choices=list(COMM_TYPES),
                    help="compare these comm types side by side instead (see lab/megatron_ring_lab/bench/strategies.py)")
    ap.add_argument("--memory", action="store_true", help="with --comm-type: also measure peak memory per type")
    ap.add_argument("--no-warmup", action="store_true", help="with --comm-type: skip the untimed warm-up call "
                    "of each type (auto's probe still runs first); for very long sequences")
    ap.add_argument("--no-limit", action="store_true", help="skip the one-thread one-process run (T1) behind "
                    "the compute-limit columns")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per spawned run")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--plot", help="write a PNG of time and memory per rank against P")
    ap.add_argument("--docs", type=int, help="packed documents: N random-length documents packed (THD) vs "
                    "each padded to 2P (see megatron_ring_lab.bench.documents)")
    ap.add_argument("--window", action="store_true", help="sliding windows S/16, S/4, S/2 vs full causal")
    ap.add_argument("--window-layouts", nargs="+", default=None, help="--window: layouts to time (default all)")
    ap.add_argument("--window-compute", action="store_true",
                    help="with --window: compute only, every rank's block tasks in one process (no ring)")
    ap.add_argument("--balance", action="store_true", help="causal work per rank (visible pairs) per layout "
                    "for realistic document-length mixes over S tokens (no timing)")
    ap.add_argument("--gpu-row", action="store_true", help="CUDA: each rank's ring schedule on one GPU vs "
                                                          "one-GPU SDPA (megatron_ring_lab.bench.gpu)")
    ap.add_argument("--tokens-per-rank", type=int, nargs="+", default=None,
                    help="with --gpu-row: rows at these tokens per rank (seq = tokens x P) instead of --seq")
    ap.add_argument("--gpu-docs", action="store_true", help="with --gpu-row: also a packed-THD row per size, a "
                    "real document-length mix vs one-GPU variable-length flash on the same stream")
    ap.add_argument("--gpu-docs-layouts", nargs="+", default=["striped"], choices=["striped", "zigzag", "doc-zigzag"],
                    help="with --gpu-docs: the packed rows' layouts (doc-zigzag: Megatron's per-document zigzag, "
                         "documents padded to multiples of 2P as --sft packs them)")
    ap.add_argument("--graphed", action="store_true", help="with --gpu-row: also each call captured into a CUDA "
                    "graph and replayed (time, efficiency)")
    ap.add_argument("--breakdown", action="store_true",
                    help="per ring step: time in kernel, merge, decode, copies, waits (megatron_ring_lab.bench.breakdown)")
    ap.add_argument("--host-time", action="store_true",
                    help="the engine's own host time per ring step and per call: loopback ring, instant kernel, "
                         "P = --world-sizes (default 2..8), blocks of --block-len tokens per rank "
                         "(megatron_ring_lab.bench.host_time)")
    ap.add_argument("--block-len", type=int, default=64, help="with --host-time: tokens per rank")
    ap.add_argument("--layer-host-time", action="store_true",
                    help="host time of one Megatron core-attention layer call (RingDotProductAttention forward+"
                         "backward, CP = 1, tiny causal sbhd block) vs the same ring_attention call made directly: "
                         "the glue's share (megatron_ring_lab.bench.layer_host_time)")
    ap.add_argument("--layer-device", default="cpu", choices=("cpu", "cuda"),
                    help="with --layer-host-time: cuda runs the calls on the GPU in bf16 (host time from launch to "
                         "return, the device idle before each call)")
    ap.add_argument("--layer-packed", action="store_true",
                    help="with --layer-host-time: a packed THD batch of three documents (64 tokens), the later layers "
                         "of a micro-batch (the same PackedSeqParams) and its first (new params each call)")
    ap.add_argument("--plan-time", action="store_true",
                    help="host time to plan a new document layout (the first layer of every micro-batch on a packed "
                         "batch: ring tasks and segment plans, the GPU's whole-block path), the slowest rank, "
                         "--world-sizes x --tokens-per-rank (default 2048 8192), --layout (default striped), web "
                         "and short document mixes; --iters new mixes per row (megatron_ring_lab.bench.plan_time)")
    ap.add_argument("--plan-tiles", action="store_true",
                    help="with --plan-time: the CPU engine's planning (tile schedules for the math kernel) instead")
    ap.add_argument("--torch-ring", action="store_true",
                    help="ours vs PyTorch's own context-parallel ring, side by side, for --seq (one or more "
                         "values with --torch-ring-seqs) x --world-sizes x causal and not "
                         "(megatron_ring_lab.bench.torch_ring)")
    ap.add_argument("--torch-ring-seqs", type=int, nargs="+", default=None, help="with --torch-ring: sequence lengths")
    ap.add_argument("--features", action="store_true",
                    help="cost of MLA head dims (padding), sinks, dropout per block (megatron_ring_lab.bench.features)")
    ap.add_argument("--dynamic-cp", nargs="?", const="long-tail", choices=["long-tail", "uniform"], default=None,
                    help="dynamic CP at max(--world-sizes) ranks: fixed CP vs Megatron's hybrid-CP scheduler vs "
                         "ours on one seeded global batch of this mix (megatron_ring_lab.bench.dynamic_cp); "
                         "MEGATRON_RING_DYNAMIC_DOCS / _SCALE / _SEED change its 64 documents / 16 / 0")
    a = ap.parse_args(argv)
    a.layout = a.layout or ("striped" if a.plan_time else "zigzag")
    if a.dynamic_cp:
        from megatron_ring_lab.bench.dynamic_cp import format_dynamic, run_dynamic_cp

        from megatron_ring import settings

        num_docs, scale, seed = settings.dynamic_mix()
        res = run_dynamic_cp(dict(world=max(a.world_sizes), mix=a.dynamic_cp, num_docs=num_docs, scale=scale,
                                  seed=seed, heads=a.heads,
                                  kv_heads=a.kv_heads or a.heads, head_dim=a.head_dim, layout=a.layout,
                                  iters=a.iters, timeout=a.timeout))
        print(format_dynamic(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2, default=str)
        return res["rows"]
    if a.torch_ring:
        from megatron_ring_lab.bench import torch_ring as tr

        seqs = a.torch_ring_seqs or [a.seq]
        ps = [p for p in a.world_sizes if p > 1]
        print(f"# ours vs PyTorch's ring: H={a.heads} D={a.head_dim} fp32, zigzag/head-tail shards; P processes x 1 "
              f"thread; fwd+bwd medians of {a.iters} (slowest rank), modes interleaved; ours/x: median of "
              f"per-iteration ratios; MiB: peak per rank, each mode alone", flush=True)
        rows = tr.run_torch_ring(ps, seqs, heads=a.heads, head_dim=a.head_dim, iters=a.iters, timeout=a.timeout)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=2)
        return rows
    if a.plan_time:
        from megatron_ring_lab.bench import plan_time as pt

        grid = [(p, t, a.layout, mix) for p in a.world_sizes if p > 1
                for t in (a.tokens_per_rank or [2048, 8192]) for mix in pt.MIXES]
        print(f"# plan time of a new document layout: one process, 1 thread; per row the median over {a.iters} new "
              f"mixes of the slowest rank", flush=True)
        rows = pt.run_plan_time(grid, mixes=a.iters, whole=not a.plan_tiles)
        print(pt.format_plan_time(rows), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=2)
        return rows
    if a.layer_host_time:
        from megatron_ring_lab.bench import layer_host_time as lh

        iters = a.iters if a.iters != 5 else 400
        shape = f"[64, 1, {a.heads}, {a.head_dim}] packed THD, 3 documents," if a.layer_packed else \
            f"[16, 1, {a.heads}, {a.head_dim}] sbhd"
        print(f"# layer host time: RingDotProductAttention fwd+bwd at CP=1 (loopback), {shape} causal on "
              f"{a.layer_device}, vs ring_attention directly; one thread; medians of {iters} calls", flush=True)
        row = lh.layer_host_times(heads=a.heads, kv_heads=a.kv_heads or a.heads,
                                  head_dim=a.head_dim, iters=iters, device=a.layer_device, packed=a.layer_packed)
        print(lh.format_layer_host_time(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(row, f, indent=2)
        return [row]
    if a.host_time:
        from megatron_ring_lab.bench import host_time as ht

        ps = a.world_sizes if a.world_sizes != [1, 2, 4] else list(range(2, 9))
        iters = a.iters if a.iters != 5 else 200
        print(f"# host time: loopback ring, instant kernel, [1, {a.block_len}, {a.heads}, {a.head_dim}] fp32 per rank, "
              f"zigzag, fwd+bwd; one process, 1 thread; medians of {iters} calls; fitted call = fixed + "
              f"per_step x 2P", flush=True)
        rows = ht.run_host_time(ps, a.block_len, a.heads, a.head_dim, iters)
        print(ht.format_host_time(rows), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=2)
        return rows
    if a.features:
        from megatron_ring_lab.bench import features as bf

        print(f"# features: S={a.seq} H={a.heads} fp32 causal={a.causal}; one process, 1 thread, ring_attention "
              f"P=1 fwd+bwd, medians of {a.iters}", flush=True)
        rows = bf.run_features(a.seq, a.heads, a.iters, a.causal)
        print(bf.format_features(rows), flush=True)
        return rows
    if a.gpu_row:
        import torch  # noqa: PLC0415

        from megatron_ring_lab.bench.gpu import gpu_row  # noqa: PLC0415
        sizes = [(p, n * p) for n in a.tokens_per_rank for p in a.world_sizes] if a.tokens_per_rank \
            else [(p, a.seq) for p in a.world_sizes]
        dtype = getattr(torch, DTYPES[a.dtype])
        rows = []
        for p, seq in sizes:
            for docs, layout in [(False, a.layout)] + [(True, lay) for lay in (a.gpu_docs_layouts if a.gpu_docs else [])]:
                rows.append(gpu_row(p, seq, a.heads, a.kv_heads or a.heads, a.head_dim, dtype,
                                    layout, a.causal, a.iters, docs=docs, graphed=a.graphed,
                                    v_head_dim=a.v_head_dim))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, if a later row runs out of time
        print(json.dumps(rows, indent=2))
        return rows
    if a.balance:
        from megatron_ring_lab.bench.documents import format_rows, run_balance

        rows = run_balance(a.world_sizes, a.seq)
        print(format_rows(rows), flush=True)
        return rows
    if a.docs or a.window:
        return _documents_main(a)
    if a.breakdown:
        return _breakdown_main(a)
    cfg = dict(world_sizes=a.world_sizes, seq=a.seq, batch=a.batch, heads=a.heads,
               kv_heads=a.kv_heads or a.heads, head_dim=a.head_dim, dtype=a.dtype, layout=a.layout,
               causal=a.causal, comm_dtypes=a.comm_dtype, head_chunks_list=a.head_chunks, iters=a.iters,
               kv_pieces_list=[None if p == "auto" else int(p) for p in a.kv_pieces],
               timeout=a.timeout, limit=not a.no_limit)
    print(f"# S={a.seq} B={a.batch} H={a.heads} H_kv={cfg['kv_heads']} D={a.head_dim} {a.dtype} "
          f"{a.layout} causal={a.causal}; ring: P processes x 1 thread; 1proc: 1 process x P threads; "
          f"medians of {a.iters} iterations (slowest rank)", flush=True)
    if a.comm_type:  # every exchange pattern side by side (lab/megatron_ring_lab/bench/strategies.py)
        from megatron_ring_lab.bench.strategies import run_comm_types
        rows = run_comm_types(dict(cfg, comm_types=a.comm_type, comm_dtype=None if a.comm_dtype[0] == "none"
                                   else a.comm_dtype[0], memory=a.memory, warmup=not a.no_warmup))
    else:
        print(_header(), flush=True)
        rows = run(cfg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    if a.plot:
        plot(rows, a.plot)
    return rows


def _breakdown_main(a) -> list[dict[str, Any]]:
    from megatron_ring_lab.bench import breakdown as bb

    cfg = dict(seq=a.seq, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads or a.heads, head_dim=a.head_dim,
               dtype_name=DTYPES[a.dtype], layout=a.layout, causal=a.causal, iters=a.iters, timeout=a.timeout,
               comm_dtype=None if a.comm_dtype[0] == "none" else a.comm_dtype[0])
    print(f"# breakdown: S={a.seq} B={a.batch} H={a.heads} D={a.head_dim} {a.dtype} {a.layout} causal={a.causal} "
          f"wire={a.comm_dtype[0]}; P processes x 1 thread; {a.iters} calls", flush=True)
    rows = []
    for world, pieces in itertools.product(a.world_sizes, a.kv_pieces):
        res = bb.run_breakdown(dict(cfg, kv_pieces=None if pieces == "auto" else int(pieces)), world)
        print(bb.format_breakdown(res), flush=True)
        rows.append(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


def _documents_main(a) -> list[dict[str, Any]]:
    from megatron_ring_lab.bench import documents as bd

    cfg = dict(heads=a.heads, head_dim=a.head_dim, layout=a.layout, iters=a.iters, layouts=a.window_layouts)
    how = ("compute only: every rank's block tasks in this process x 1 thread, no ring; best of "
           f"{a.iters} (slowest rank)" if a.window and a.window_compute else
           f"P processes x 1 thread; fwd+bwd medians of {a.iters} (slowest rank); MiB sent per rank per fwd+bwd")
    print(f"# S={a.seq} H={a.heads} D={a.head_dim} fp32 causal; {how}; calls = kernel calls per rank per fwd",
          flush=True)
    rows = []
    for world in a.world_sizes:
        if a.docs:
            rows += bd.run_docs(world, a.seq, a.docs, cfg, a.timeout)
        if a.window and a.window_compute:
            rows += bd.run_window_compute(world, a.seq, cfg, reps=a.iters)
        elif a.window:
            rows += bd.run_window(world, a.seq, cfg, a.timeout)
    for kind in ("docs", "window"):
        sub = [r for r in rows if (kind in r) == (kind == "docs")] if kind == "docs" else \
            [r for r in rows if "window" in r]
        if sub:
            print(bd.format_rows(sub), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
