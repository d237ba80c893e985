"""Benchmark rows for packed documents and sliding windows (``python -m megatron_ring_lab.benchmark --docs N``
or ``--window``; see :func:`main`).

* ``--docs N``: N documents of random lengths (seeded; lengths 1 .. 2*S/N), packed into one THD stream
  (padded at the END only, to the layout's multiple), causal, vs the SAME documents each padded to a
  multiple of 2P (what TransformerEngine / PyTorch require) in a longer stream. Rows: forward+backward
  time (median, slowest rank), peak memory per rank above the baseline, bytes each rank sends per
  forward+backward, kernel calls per rank per forward, and kernel calls with one call per
  (document, block) piece (what a per-document loop would make).
* ``--window``: causal attention over S tokens with windows S/16, S/4, S/2 vs full causal: time, bytes,
  ring steps, for the zigzag and contiguous layouts; the four variants are timed interleaved (iteration
  by iteration) in the same P processes, so machine noise hits them alike.

The two ``--docs`` cases run in their own sets of P processes (one thread each): peak memory is per case.
"""
from __future__ import annotations

import random
import statistics
from typing import Any

__all__ = ["run_docs", "run_window", "doc_lengths"]


def doc_lengths(n: int, seq: int, seed: int = 0) -> list[int]:
    """``n`` random document lengths (1 .. 2*seq/n, a few of length 1) whose sum is at most ``seq``."""
    rnd = random.Random(seed)
    lens = [rnd.randint(1, max(1, 2 * seq // n)) for _ in range(n)]
    lens[:: max(1, n // 8)] = [1] * len(lens[:: max(1, n // 8)])
    while sum(lens) > seq:
        i = lens.index(max(lens))
        lens[i] = max(1, lens[i] - (sum(lens) - seq))
    return lens


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Times every variant of ``cfg["variants"]`` (dicts with T, cu, window) in the same processes,
    interleaved iteration by iteration, so machine noise hits all of them alike."""

    import torch
    import torch.distributed as dist

    from megatron_ring import ring_attention
    from megatron_ring.timing import seconds
    from megatron_ring_lab.bench.measure import peak_mib, rss_mib, warm_up
    from megatron_ring.transport.ring import Ring
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.schedules.masks import AttentionMask, needed_steps, schedule

    torch.set_num_threads(1)
    layout = cfg["layout"]
    warm_up(lambda *t: ring_attention(*t, causal=True, layout=layout), 2 * world, torch.float32)
    base = rss_mib()
    ring = Ring(dist.group.WORLD, torch.device("cpu"))
    runs = []
    for var in cfg["variants"]:
        T = var["T"]
        s = T // world
        cu = torch.tensor(var["cu"], dtype=torch.int32) if var["cu"] is not None else None
        window = tuple(var["window"]) if var["window"] is not None else None
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(s, cfg["heads"], cfg["head_dim"], generator=g, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)

        def fwd_bwd(q=q, k=k, v=v, dout=dout, cu=cu, window=window):
            ring_attention(q, k, v, qkv_format="thd", cu_seqlens=cu, causal=True, layout=layout, window=window,
                           ring=ring).backward(dout)

        before = sum(ring.bytes_sent.values())
        fwd_bwd()  # warm-up (schedules, consistency check); also gives the bytes of one call
        lay = get_layout(layout)
        rule = AttentionMask(True, tuple(var["cu"]) if var["cu"] is not None else None,
                             (window[0], -1) if window is not None else None)
        steps = needed_steps(lay, rule, world, s)
        calls = sum(len(schedule(lay, rule, world, rank, (rank - t) % world, s)) for t in range(steps))
        runs.append(dict(fn=fwd_bwd, times=[], bytes=sum(ring.bytes_sent.values()) - before, calls=calls,
                         steps=steps))
    for _ in range(cfg["iters"]):
        for r in runs:
            r["times"].append(seconds(r["fn"], before=dist.barrier))
    peak = peak_mib() - base
    return [dict(times=r["times"], bytes=r["bytes"], calls=r["calls"], steps=r["steps"], peak=peak) for r in runs]


def _spawn_all(world: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    from megatron_ring_lab.launch import run_on_ranks

    per_rank = run_on_ranks(_worker, world, cfg, timeout=timeout)
    out = []
    for i in range(len(cfg["variants"])):
        rows = [r[i] for r in per_rank]
        iters = len(rows[0]["times"])
        slowest = [max(r["times"][j] for r in rows) for j in range(iters)]
        out.append(dict(ms=1e3 * statistics.median(slowest), mib_sent=max(r["bytes"] for r in rows) / 2**20,
                        calls=max(r["calls"] for r in rows), steps=rows[0]["steps"],
                        peak_mib=max(r["peak"] for r in rows)))
    return out


def _spawn(world: int, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One variant in its own processes (so its peak memory is its own)."""
    var = dict(T=cfg["T"], cu=cfg["cu"], window=cfg["window"])
    return _spawn_all(world, dict(cfg, variants=[var]), timeout)[0]


def _per_doc_calls(cu: list[int], world: int, T: int, layout: str) -> int:
    """Kernel calls per forward if every (document, visiting block) piece were its own call (max rank)."""
    import torch

    from megatron_ring.schedules.layouts import get_layout

    lay = get_layout(layout)
    ids = torch.searchsorted(torch.tensor(cu), torch.arange(T), right=True) - 1
    ids[torch.arange(T) >= cu[-1]] = -1
    per_rank = [set(ids[lay.positions(T, world, r)].tolist()) - {-1} for r in range(world)]
    return max(sum(len(per_rank[r] & per_rank[src]) for src in range(world)) for r in range(world))


def run_docs(world: int, seq: int, n_docs: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    mult = 2 * world
    lens = doc_lengths(n_docs, seq - mult)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = -(-cu[-1] // mult) * mult
    padded = [-(-n // mult) * mult for n in lens]  # each document padded to a multiple of 2P
    cup, cu_fill = [0], [0]
    for n, p in zip(lens, padded):
        cu_fill += [cu_fill[-1] + n] + ([cu_fill[-1] + p] if p > n else [])  # filler: its own document
        cup.append(cup[-1] + p)
    rows = []
    for name, stream, bounds in (("packed", T, cu), ("padded to 2P", cup[-1], cu_fill)):
        res = _spawn(world, dict(cfg, T=stream, cu=bounds, window=None), timeout)
        rows.append(dict(case=name, P=world, docs=n_docs, tokens=stream, per_doc_calls=_per_doc_calls(
            bounds, world, stream, cfg["layout"]), **res))
    return rows


def _window_cases(seq: int) -> tuple[tuple[str, int | None], ...]:
    return (("full causal", None), ("S/2", seq // 2), ("S/4", seq // 4), ("S/16", seq // 16))


def run_window(world: int, seq: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Windows vs full causal, per layout, timed interleaved in the same processes (peak memory is then
    the max over the variants, so it is not reported per row)."""
    rows = []
    for layout in cfg.get("layouts") or ("zigzag", "contiguous", "striped"):
        variants = [dict(T=seq, cu=None, window=None if w is None else (w, 0)) for _, w in _window_cases(seq)]
        res = _spawn_all(world, dict(cfg, layout=layout, variants=variants), timeout)
        full = res[0]["ms"]
        for (name, w), r in zip(_window_cases(seq), res):
            r.pop("peak_mib")
            rows.append(dict(case=name, layout=layout, P=world, window=w, **r, vs_full=r["ms"] / full))
    return rows


def run_window_compute(world: int, seq: int, cfg: dict[str, Any], reps: int = 5) -> list[dict[str, Any]]:
    """Windows vs full causal, compute only, in THIS process (1 thread): every rank's forward+backward
    block tasks over all its ring steps (the engine's kernel dispatch, no communication, no merge),
    each variant timed ``reps`` times interleaved; ``ms`` is the slowest rank's minimum (the figure
    least disturbed by other jobs on a shared machine)."""
    import torch

    from megatron_ring.schedules import masks
    from megatron_ring.core.plan import RingPlan
    from megatron_ring.kernels.block import FlashCPUKernel
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.timing import seconds

    torch.set_num_threads(1)
    s, h, d = seq // world, cfg["heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, s, d, generator=g) for _ in range(4))
    rows = []
    runs = _window_cases(seq)
    for layout in cfg.get("layouts") or ("zigzag", "contiguous", "striped"):
        lay = get_layout(layout)
        best = [[float("inf")] * world for _ in runs]
        calls = [0] * len(runs)
        for _ in range(reps):
            for i, (_, w) in enumerate(runs):
                rule = None if w is None else masks.AttentionMask(True, None, (w, 0))
                plan = RingPlan(ring=None, layout=lay, causal=True, scale=d ** -0.5, kernel=FlashCPUKernel(),
                                codec=None, mask=rule)
                steps = world if rule is None else masks.needed_steps(lay, rule, world, s)
                for r in range(world):
                    tasks = [t for step in range(steps) for t in (
                        lay.block_tasks(True, world, r, (r - step) % world, s) if rule is None
                        else masks.schedule(lay, rule, world, r, (r - step) % world, s))]
                    calls[i] = max(calls[i], len(tasks))

                    def compute(tasks=tasks, plan=plan):
                        for t in tasks:
                            out, lse, _ = plan.forward_block(t, q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv])
                            plan.backward_block(t, dout[:, :, t.q], q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv],
                                                out, lse.contiguous())
                    best[i][r] = min(best[i][r], seconds(compute))
        full = max(best[0])
        for (name, w), b, c in zip(runs, best, calls):
            rows.append(dict(case=name, layout=layout, P=world, window=w, compute_ms=1e3 * max(b), calls=c,
                             vs_full=max(b) / full))
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if k not in ()]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join((f"{r[k]:.3f}" if abs(r[k]) < 10 else f"{r[k]:.1f}") if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def mixes(T: int, seed: int = 0) -> dict[str, list[int]]:
    """Realistic document-length mixes over a stream of T tokens (lengths sum to T, no padding)."""
    rnd = random.Random(seed)

    def fill(draw):
        lens = []
        while sum(lens) < T:
            lens.append(max(1, min(T - sum(lens), int(draw()))))
        return lens

    return {
        "one document": [T],
        "many short (mean T/256)": fill(lambda: rnd.expovariate(256 / T)),
        "lognormal (median T/64)": fill(lambda: rnd.lognormvariate(0, 1.0) * T / 64),
        "web mix (80% short, 20% long)": fill(lambda: rnd.expovariate(128 / T) if rnd.random() < 0.8
                                              else rnd.uniform(T / 8, T / 2)),
        "few long (T/3 .. T/2)": fill(lambda: rnd.uniform(T / 3, T / 2)),
    }


def run_balance(worlds: list[int], T: int, seeds: int = 3) -> list[dict[str, Any]]:
    """Causal work (visible pairs) per rank: max/mean per layout and mix (worst over ``seeds`` seeds)."""
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.schedules.masks import AttentionMask, visible_pairs

    rows = []
    for world in worlds:
        for name in mixes(T):
            worst = {}
            for seed in range(seeds):
                lens = mixes(T, seed)[name]
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + n)
                rule = AttentionMask(True, tuple(cu))
                for layout in ("zigzag", "striped", "contiguous"):
                    work = [visible_pairs(get_layout(layout), rule, world, r, T // world) for r in range(world)]
                    worst[layout] = max(worst.get(layout, 0.0), max(work) / (sum(work) / world))
            rows.append(dict(P=world, mix=name, **{f"{k} max/mean": round(v, 3) for k, v in worst.items()}))
    return rows
