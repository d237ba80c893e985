"""Host time to plan a new document layout (``python -m megatron_ring_lab.benchmark --plan-time``).

A packed batch brings new documents, so a new signature, in every micro-batch: the first layer's call of each
micro-batch plans its ring afresh on the host (the tasks of every ring step, and for each masked task the segment
plan of the variable-length kernel), the later layers reuse that plan. On a GPU that host time comes before the
first kernel of the micro-batch can launch; the GPU row (``--gpu-row --gpu-docs``) does not see it, as it times
one document mix over and over.

What is timed: for each of ``mixes`` new document mixes and each rank, the planning that rank's first call does
on the GPU's path (whole blocks on a variable-length kernel): ``schedule(layout, rule, P, rank, src, s, s,
one_task=...)`` for every ring step (as the engine calls it, without dropout), then ``plan_for`` of each masked task;
per mix the slowest rank (the ring waits for it); the row gives the median over mixes. ``--tiles``: the planning
of the CPU engine instead (the math kernel: tile schedules, ``schedule(layout, rule, P, rank, src, s)``, no segment
plans), which the lab and CI pay for every new mix. Two document mixes: ``web``
(:func:`packed_lengths`: 80% short documents, 20% long ones up to a quarter of the stream) and ``short`` (many
short documents, exponential lengths of mean 512 tokens); the layouts: ``striped``, ``zigzag`` (over the whole
stream) and ``doc-zigzag`` (Megatron's per-document zigzag, documents padded to multiples of 2P: ``--sft``).

This module imports only the library's planning pieces (``schedule``, ``AttentionMask``, ``get_layout``,
``plan_for``) and nothing of ``megatron_ring_lab``, so ``scripts/bench_revisions.py --plan-time`` runs this very
file against an older revision of the library, side by side.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from megatron_ring.kernels.varlen_plan import plan_for
from megatron_ring.schedules.layouts import TaskKind, get_layout
from megatron_ring.schedules.masks import AttentionMask, DocumentZigzag, schedule

try:  # the engine's test of a whole block as one task (revisions before it cut every block into runs of rows)
    from megatron_ring.kernels.varlen_plan import one_task
except ImportError:
    one_task = None

__all__ = ["packed_lengths", "short_lengths", "megatron_padded", "packed_documents", "plan_times", "run_plan_time",
           "format_plan_time", "MIXES"]


def packed_lengths(seq: int, seed: int = 0) -> list[int]:
    """A real document-length mix filling ``seq`` tokens: 80% short documents (exponential, mean seq/128),
    20% long ones (uniform seq/16 .. seq/4); every document at most a quarter of the stream."""
    rnd = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < seq:
        draw = rnd.expovariate(128 / seq) if rnd.random() < 0.8 else rnd.uniform(seq / 16, seq / 4)
        lens.append(max(1, min(seq - sum(lens), seq // 4, int(draw))))
    return lens


def short_lengths(seq: int, seed: int = 0, mean: int = 512) -> list[int]:
    """Many short documents filling ``seq`` tokens: exponential lengths of mean ``mean`` tokens."""
    rnd = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < seq:
        lens.append(max(1, min(seq - sum(lens), int(rnd.expovariate(1 / mean)))))
    return lens


#: the document mixes of a row, by name
MIXES = {"web": packed_lengths, "short": short_lengths}


def _cu(lengths: list[int]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def megatron_padded(lengths: list[int], world: int, seq: int) -> tuple[list[int], tuple[int, ...]]:
    """Megatron's per-document packing (``--sft``): each document padded to a multiple of 2P and split zigzag on its
    own. Returns the padded slots' boundaries (``cu_seqlens_padded``, what :class:`DocumentZigzag` takes) and the
    ring's documents, each slot's filler a document of its own (as the Megatron glue makes them); documents past
    ``seq`` are dropped, the rest of the stream is one more slot."""
    c, slots, docs = 2 * world, [0], [0]
    for n in lengths:
        m = -(-n // c) * c
        if slots[-1] + m > seq:
            break
        docs += [slots[-1] + n] + ([slots[-1] + m] if m > n else [])
        slots.append(slots[-1] + m)
    if slots[-1] < seq:
        slots.append(seq)
        docs.append(seq)
    return slots, tuple(docs)


def packed_documents(layout: str, lengths: list[int], world: int, seq: int):
    """A packed stream of documents of ``lengths`` as the ring takes it: ``(cu_seqlens, layout)``. ``"doc-zigzag"``:
    Megatron's per-document zigzag (:func:`megatron_padded`; the layout its :class:`DocumentZigzag`), else the
    documents as they are and ``layout`` itself."""
    if layout == "doc-zigzag":
        slots, cu = megatron_padded(lengths, world, seq)
        return cu, DocumentZigzag(slots)
    return _cu(lengths), layout


def plan_times(world: int, tokens_per_rank: int, layout: str = "striped", mix: str = "web", mixes: int = 5,
               causal: bool = True, window: tuple[int, int] | None = None, whole: bool = True) -> dict[str, Any]:
    """One row (see the module doc): ``plan_ms``, the median over ``mixes`` new document mixes of the slowest
    rank's planning; ``docs``, the mixes' median document count; ``masked`` and ``planned``, in the last mix, the
    most masked tasks of any rank's forward and how many of those have a segment plan (the others fall back to the
    math kernel).
    ``layout="doc-zigzag"``: Megatron's per-document zigzag (:class:`DocumentZigzag`) of the mix's documents each
    padded to a multiple of 2P (:func:`megatron_padded`). ``whole=False``: the CPU engine's tile schedules (no segment
    plans: ``planned`` is 0)."""
    seq = world * tokens_per_rank
    per_mix, docs, masked, planned = [], [], 0, 0
    for seed in range(1, mixes + 1):  # a new mix each time: nothing of the last one's plan is reused
        cu, lay = packed_documents(layout, MIXES[mix](seq, seed), world, seq)
        lay = get_layout(lay)
        docs.append(len(cu) - 1)
        rule = AttentionMask(causal, cu, window)
        slowest, counts = -1.0, (0, 0)
        for rank in range(world):
            n_masked = n_planned = 0
            t0 = time.perf_counter()
            for step in range(world):
                src = (rank - step) % world
                tasks = (schedule(lay, rule, world, rank, src, tokens_per_rank, tokens_per_rank,
                                  **({"one_task": one_task} if one_task else {})) if whole
                         else schedule(lay, rule, world, rank, src, tokens_per_rank))
                for task in tasks:
                    if task.kind is TaskKind.MASKED:
                        n_masked += 1
                        n_planned += whole and plan_for(task.mask) is not None
            slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
            counts = max(counts, (n_masked, n_planned))
        per_mix.append(slowest)
        masked, planned = counts
    return dict(P=world, tokens_per_rank=tokens_per_rank, layout=layout, mix=mix, causal=causal, whole=whole,
                window=list(window) if window else None, docs=statistics.median(docs),
                plan_ms=statistics.median(per_mix), plan_ms_mixes=per_mix, masked=masked, planned=planned)


#: the rows ``scripts/bench_revisions.py --plan-time`` compares: (P, tokens per rank, layout, mix)
GRID = [(4, 2048, "striped", "web"), (8, 2048, "striped", "short"), (4, 8192, "striped", "web"),
        (8, 8192, "striped", "web"), (8, 8192, "striped", "short"), (8, 8192, "zigzag", "web"),
        (4, 2048, "doc-zigzag", "web"), (8, 8192, "doc-zigzag", "web")]


def run_plan_time(grid=GRID, mixes: int = 5, whole: bool = True) -> list[dict[str, Any]]:
    return [plan_times(p, t, layout, mix, mixes, whole=whole) for p, t, layout, mix in grid]


def format_plan_time(rows: list[dict[str, Any]]) -> str:
    lines = ["| P | tokens per rank | layout | mix | docs | masked tasks, most of a rank (planned) "
             "| plan ms (slowest rank) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['P']} | {r['tokens_per_rank']} | {r['layout']} | {r['mix']} | {r['docs']:.0f} | "
                     f"{r['masked']} ({r['planned']}) | {r['plan_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5, help="new document mixes per row")
    ap.add_argument("--json", action="store_true", help="print one RESULT line of JSON (scripts/bench_revisions.py)")
    ap.add_argument("--tiles", action="store_true", help="the CPU engine's planning (tile schedules) instead of the "
                    "GPU's (whole blocks, segment plans)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = run_plan_time(mixes=a.iters, whole=not a.tiles)
    print("RESULT " + json.dumps(rows) if a.json else format_plan_time(rows), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
