"""Cost model: predicted forward+backward time, bytes and memory per rank for every comm type.

Inputs are plain numbers, so the same model serves ``comm_type="auto"`` (with probed or configured
machine numbers) and the planner CLI (``python -m megatron_ring_lab.plan``).

Machine (:class:`Machine`): ``flops`` = attention forward rate F (flop/s per rank), ``bwd_flops`` = its
backward rate, ``bw_intra`` / ``bw_inter`` = link bandwidth B (bytes/s per rank, inside / across
nodes), ``latency`` = seconds per message, ``call_overhead`` = seconds per block task, ``overlap`` =
how much of a transfer hides under compute (1 on GPUs, whose copy engines/NICs work beside the SMs; 0
on CPUs, where gloo's copies use the same cores), ``gpus_per_node``.

Compute comes from the layout's own schedule: the area of every block task (rows x keys, half of a
square for a causal task) for every (rank, source) pair, times ``4 b h d`` flops (QK^T and PV), divided
by F; backward uses the backward rate. So causal skipping and the layout's balance are in the model.
Documents are not: a packed batch is predicted as one sequence, and a layout made from its documents as the layout it
is for one document (``Layout.without_documents``: Megatron's per-document zigzag is predicted as the zigzag; its
balance per ring step is the zigzag's within every document).

* ``p2p``: P steps; step t costs ``max(compute_t, transfer)`` where compute_t is the slowest rank's
  work for its source at that step and transfer is one K/V block (``latency + bytes/B``). This is the
  seed rule: a step hides its transfer when the chunk is long enough (C >= F/B per byte of K/V). The
  engine streams a block in ``n = kv_pieces`` pieces of K/V heads (docs/design.md, "Sub-block
  streaming"): each piece's exchange overlaps that piece's compute, so a step is ``n`` messages (n
  latencies) of ``1/n`` of the block each, overlapped piece by piece. Backward: the fp32 dK/dV
  accumulator travels the same way, each piece's hop overlapping the compute of the next piece; of the
  ``P n`` piece hops only the last one (the last piece's hop home, ``1/n`` of an fp32 dK/dV block) is
  in the open. The last step sends no K/V.
* ``all_gather``: gather of P-1 K/V blocks (ring algorithm, P-1 messages), pipelined with the compute in
  ``gather_head_groups`` groups of K/V heads (the first group's gather is exposed); backward gathers again and
  reduce-scatters fp32 dK/dV (P-1 messages of one block). Its tasks (and a2a+p2p's super-blocks') are the
  view's (``schedules/views.py``): full tasks of neighbouring shards are one.
* ``a2a``: all-to-all of Q, K/V and O forward, dO, dQ, dK/dV backward, P-1 messages each, not
  overlapped with compute; heads split by :func:`~megatron_ring.core.heads.head_split` (rank j: query
  heads ``q[j]``, K/V heads ``kv[j]``), so an all-to-all of per-rank head counts ``n_j`` costs the
  busiest rank's bytes, ``max_i max(sum_{j != i} n_j, (P-1) n_i)`` heads of one shard ((P-1)/P of the
  tensor when the split is even); dK/dV travel in fp32 when a K/V head goes to several ranks. Compute
  is the whole sequence for the largest head slice (``ceil(h/P)`` heads), one task (the sequence put in its
  order: one kernel call each way); a rank whose heads are not
  one even GQA grouping runs the engine once per run (``HeadSplit.runs``: the outer ring's messages).
* ``a2a+p2p``: inner all-to-all (size n) as ``a2a``, plus the ring of ``a2a`` super-blocks over the
  outer group (size P/n) as ``p2p``.

Links: traffic that stays inside a node moves at ``bw_intra``, traffic between nodes at ``bw_inter``
(ranks ``gpus_per_node`` per node, consecutive): a ring spanning nodes runs at the inter-node rate; an
all-to-all or all-gather is as slow as its inter-node share at the inter-node rate.

Memory per rank per layer (bytes): the seed's ``12 C d`` generalised (:func:`activation_bytes`):
``C dh ((2h + 2h_kv) e_c + 2 h_kv w)`` -- Q, O, K, V in the compute dtype (e_c bytes) plus one K/V
block in flight in the wire dtype (w bytes); for MHA in bf16 that is exactly ``12 C d``. Each
strategy adds its workspace at the backward peak (:func:`workspace_bytes`); for the ring (docs/design.md,
"Memory") with ``n`` pieces: the K/V slots beyond that one block (``(n + 1) / n`` blocks in all: ``1/n``
of a block more), the dK/dV slots (``(n + 1) / n`` fp32 K/V blocks, ``n`` of the ``n + 1`` slots being
the returned gradients), the fp32 dQ accumulator and the block kernel's gradients of one piece
(``(h + 2 h_kv) C dh e_c / n``). ``n = 1`` is double buffering: one more K/V block and two fp32 dK/dV
blocks. Checked against the benchmark's per-rank peaks (docs/design.md, "Memory").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ring.core.heads import head_split
from megatron_ring.wire.codecs import wire_dtype
from megatron_ring.schedules.layouts import Layout, get_layout
from megatron_ring.schedules.views import GatheredView, GroupedView

__all__ = ["Machine", "Problem", "predict", "predict_all", "pick", "activation_bytes", "workspace_bytes",
           "candidate_types", "BWD_FLOP_FACTOR"]

#: backward flops / forward flops of flash attention (5 matmuls with recompute vs 2)
BWD_FLOP_FACTOR = 2.5


@dataclass(frozen=True)
class Machine:
    flops: float  # forward attention flop/s per rank
    bw_intra: float  # bytes/s per rank inside a node
    latency: float = 20e-6  # seconds per message
    bw_inter: float | None = None  # bytes/s per rank between nodes (None: = bw_intra)
    gpus_per_node: int | None = None  # None: every rank on one node
    bwd_flops: float | None = None  # backward flop/s (None: = flops)
    call_overhead: float = 0.0  # seconds per block task (kernel launch, merge, slicing), forward
    overlap: float = 1.0  # fraction of a transfer that can hide under compute (GPU: 1; CPU: 0, same cores)

    def bw(self, span: int, stride: int = 1) -> float:
        """Bandwidth of a collective over ``span`` ranks ``stride`` apart (consecutive global ranks)."""
        gpn = self.gpus_per_node
        crosses = gpn is not None and span * stride > gpn
        return (self.bw_inter or self.bw_intra) if crosses else self.bw_intra


@dataclass(frozen=True)
class Problem:
    batch: int
    seq: int  # global sequence length S
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    layout: str | Layout = "zigzag"  # a name, or a Layout object (e.g. DocumentZigzag)
    elem_bytes: int = 2  # compute dtype
    wire_bytes: float | None = None  # K/V bytes per element on the wire (None: elem_bytes)
    gather_head_groups: int = 2  # all_gather: K/V gathered in this many groups of heads, one ahead of use
    kv_pieces: int = 1  # ring: K/V pieces a block streams in (the engine's n, a divisor of the K/V heads)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def w(self) -> float:
        return self.elem_bytes if self.wire_bytes is None else self.wire_bytes


def _area(t, c: int) -> float:
    rows = t.q.stop - t.q.start
    cols = t.kv.stop - t.kv.start
    return rows * (rows + 1) / 2 if t.causal else rows * cols


def _pair_area(layout, causal: bool, world: int, rank: int, src: int, c: int) -> tuple[float, int]:
    """(area, number of tasks) of (rank's queries, src's keys)."""
    tasks = layout.block_tasks(causal, world, rank, src, c)
    return sum(_area(t, c) for t in tasks), len(tasks)


def _compute(m: "Machine", area: float, tasks: int, flop_per_area: float) -> tuple[float, float]:
    """(fwd, bwd) seconds for ``tasks`` kernel calls covering ``area``."""
    fb = m.bwd_flops or m.flops
    return (area * flop_per_area / m.flops + tasks * m.call_overhead,
            area * flop_per_area * BWD_FLOP_FACTOR / fb + 2 * tasks * m.call_overhead)


def _both(m: "Machine", compute: float, transfer: float) -> float:
    """Time of a compute and a transfer started together: max() when fully overlapped, sum when not."""
    return compute + transfer - m.overlap * min(compute, transfer)


def _xfer(nbytes: float, bw: float, lat: float, messages: int = 1) -> float:
    return messages * lat + nbytes / bw if nbytes else 0.0


def candidate_types(heads: int, world: int, inner: int | None) -> list[str]:
    """Comm types that can run: a2a needs h >= P (a query head per rank); a2a+p2p an inner size <= h."""
    out = ["p2p", "all_gather"]
    if heads >= world:
        out.append("a2a")
    if inner and 1 < inner < world and world % inner == 0 and heads >= inner:
        out.append("a2a+p2p")
    return out


def _ring(pb: Problem, m: Machine, world: int, flop_per_area: float, kv_bytes: float, dkv_bytes: float,
          area_of, bw: float) -> tuple[float, float]:
    """(fwd, bwd) seconds of a ring whose step t costs the slowest rank's ``area_of(rank, t)``, a block
    streaming in ``pb.kv_pieces`` pieces (see the module doc)."""
    n = max(1, pb.kv_pieces) if world > 1 else 1
    fwd = bwd = 0.0
    for t in range(world):
        cf, cb = max((_compute(m, *area_of(r, t), flop_per_area) for r in range(world)), key=lambda x: x[0])
        last = t == world - 1
        kv = 0.0 if last else _xfer(kv_bytes, bw, m.latency, n)
        # dK/dV piece hops overlapped by this step's compute: all n, but the last step's last one
        hops = 0 if world == 1 else (n - 1 if last else n)
        dkv = _xfer(dkv_bytes * hops / n, bw, m.latency, hops)
        fwd += _both(m, cf, kv)
        bwd += _both(m, cb, kv + dkv)
    if world > 1:
        bwd += _xfer(dkv_bytes / n, bw, m.latency)  # the last piece's hop home, in the open
    return fwd, bwd


def predict(comm_type: str, pb: Problem, world: int, m: Machine, inner: int | None = None) -> dict:
    """Predicted seconds (fwd, bwd, total), bytes sent per rank and memory per rank for one layer."""
    lay = get_layout(pb.layout)
    b, h, hk, d, S = pb.batch, pb.heads, pb.kv_heads, pb.head_dim, pb.seq
    c = S // world  # local chunk
    kv_wire = 2 * b * hk * c * d * pb.w
    dkv32 = 2 * b * hk * c * d * 4
    fpa = 4 * b * h * d  # flops per unit of (query, key) area, all heads
    if comm_type == "p2p":
        fwd, bwd = _ring(pb, m, world, fpa, kv_wire, dkv32,
                         lambda r, t: _pair_area(lay, pb.causal, world, r, (r - t) % world, c), m.bw(world))
        sent = (world - 1) * kv_wire + world * dkv32 * (world > 1) + (world - 1) * kv_wire
    elif comm_type == "all_gather":
        n = max(1, min(pb.gather_head_groups, hk))
        # a rank's queries against every shard, as the strategy's view runs them (full tasks coalesced)
        cf, cb = max((_compute(m, *_pair_area(GatheredView(lay, world, r), pb.causal, 1, 0, 0, c), fpa)
                      for r in range(world)), key=lambda x: x[0])
        cf, cb = cf + (n - 1) * _compute(m, 0, world, fpa)[0], cb + (n - 1) * _compute(m, 0, world, fpa)[1]
        bw = m.bw(world)
        gather = _xfer((world - 1) * kv_wire, bw, m.latency, world - 1)
        rs = _xfer((world - 1) * dkv32, bw, m.latency, world - 1)
        fwd = gather / n + (n - 1) * _both(m, cf / n, gather / n) + cf / n
        bwd = gather / n + (n - 1) * _both(m, cb / n, (gather + rs) / n) + _both(m, cb / n, rs / n) + rs / n
        sent = 2 * (world - 1) * kv_wire + (world - 1) * dkv32
    elif comm_type in ("a2a", "a2a+p2p"):
        n = world if comm_type == "a2a" else inner
        if not n or world % n or h < n:
            raise ValueError(f"{comm_type} cannot run with P={world}, inner={inner}, h={h}")
        outer = world // n
        hs = _HeadShares(h, hk, n)
        bw = m.bw(n)
        unit = b * c * d  # elements of one head of one shard
        kv_unit = 2 * unit * (pb.w if comm_type == "a2a" else pb.elem_bytes)  # K and V
        dkv_unit = 2 * unit * (4 if hs.fp32_grads else pb.elem_bytes)
        q_sent, q_worst = hs.a2a(hs.q, unit * pb.elem_bytes)
        kv_sent, kv_worst = hs.a2a(hs.kv, kv_unit)
        dkv_sent, dkv_worst = hs.a2a(hs.kv, dkv_unit)
        a2a = lambda nbytes: _xfer(nbytes, bw, m.latency, n - 1)  # noqa: E731
        fwd_comm = a2a(q_worst) + a2a(kv_worst) + a2a(q_worst)
        bwd_comm = a2a(q_worst) + a2a(q_worst) + a2a(dkv_worst)
        grouped = _GroupedAreas(lay, pb.causal, world, n, c)
        # after the a2a a rank holds max(q) heads of n shards (the slowest rank), and its (locally
        # repeated) K/V heads travel the outer ring: its step t covers the super-blocks
        ring_kv = 2 * b * hs.kv_local * n * c * d
        ring_f, ring_b = _ring(pb, m, outer, 4 * b * hs.q_max * d, ring_kv * pb.w, ring_kv * 4,
                               lambda o, t: grouped(o, (o - t) % outer), m.bw(outer, stride=n))
        extra = hs.runs - 1  # a rank whose heads are not one even GQA grouping runs the ring once per run
        ring_f += extra * (outer - 1) * m.latency
        ring_b += extra * (2 * outer - 1) * m.latency
        fwd, bwd = fwd_comm + ring_f, bwd_comm + ring_b
        sent = max(4 * qs + ks + ds for qs, ks, ds in zip(q_sent, kv_sent, dkv_sent))
        if outer > 1:
            sent += 2 * (outer - 1) * ring_kv * pb.w + outer * ring_kv * 4
    else:
        raise ValueError(f"unknown comm type {comm_type!r}")
    return {"comm_type": comm_type, "fwd_s": fwd, "bwd_s": bwd, "time_s": fwd + bwd, "bytes_per_rank": sent,
            "activation_bytes": activation_bytes(pb, world),
            "workspace_bytes": workspace_bytes(comm_type, pb, world, inner)}


class _HeadShares:
    """Per-rank head counts of :func:`~megatron_ring.core.heads.head_split` for the cost model."""

    def __init__(self, h: int, hk: int, n: int) -> None:
        split = head_split(h, hk, n)
        self.q = [sl.stop - sl.start for sl in split.q]
        self.kv = [sl.stop - sl.start for sl in split.kv]
        self.q_max = max(self.q)
        self.kv_local = max(self.kv)  # K/V heads a rank computes with (and a2a+p2p's outer ring carries)
        self.fp32_grads = split.shared
        self.runs = max(len(split.runs(j)) for j in range(n))  # engine calls per rank (uneven GQA groupings)

    @staticmethod
    def a2a(counts: list[int], unit: float) -> tuple[list[float], float]:
        """(bytes each rank sends, the busiest rank's bytes sent or received) of an all-to-all that
        gathers rank j's ``counts[j]`` heads (``unit`` bytes each) of every shard onto rank j."""
        n, tot = len(counts), sum(counts)
        sent = [(tot - x) * unit for x in counts]
        return sent, max(max(tot - x, (n - 1) * x) for x in counts) * unit


class _GroupedAreas:
    """(area, tasks) of super-block pairs (outer rank o, outer source j) of ``n`` base shards each, as the
    strategy's view runs them (full tasks coalesced); cached."""

    def __init__(self, lay, causal: bool, world: int, n: int, c: int) -> None:
        self.lay, self.causal, self.world, self.n, self.c = lay, causal, world, n, c
        self.cache: dict[tuple[int, int], float] = {}

    def __call__(self, o: int, j: int) -> tuple[float, int]:
        if (o, j) not in self.cache:
            n, outer = self.n, self.world // self.n
            area, tasks = _pair_area(GroupedView(self.lay, n), self.causal, outer, o, j, n * self.c)
            # a2a (one super-block): the whole sequence, put in its order, is one task (strategies/a2a.py)
            self.cache[(o, j)] = (area, 1 if outer == 1 else tasks)
        return self.cache[(o, j)]


def activation_bytes(pb: Problem, world: int) -> float:
    """Per rank per layer: Q, O, K, V (compute dtype) + one K/V block in flight (wire): 12 C d for MHA bf16."""
    c = pb.seq // world
    return c * pb.head_dim * ((2 * pb.heads + 2 * pb.kv_heads) * pb.elem_bytes + 2 * pb.kv_heads * pb.w)


def workspace_bytes(comm_type: str, pb: Problem, world: int, inner: int | None = None) -> float:
    """Transient per-rank bytes at the backward peak beyond :func:`activation_bytes` (one layer at a time):
    the strategy's buffers, and the block kernel's gradients (dQ, dK, dV in the compute dtype) of the
    largest unit it runs the backward on: one piece of a ring step, one head group of the gathered K/V,
    the head-sharded full sequence of an all-to-all."""
    c, d, h, hk, b = pb.seq // world, pb.head_dim, pb.heads, pb.kv_heads, pb.batch
    kv_w, kv_c = 2 * c * hk * d * pb.w * b, 2 * c * hk * d * pb.elem_bytes * b
    dkv32, acc32 = 2 * c * hk * d * 4 * b, c * h * d * 4 * b
    pieces = max(1, pb.kv_pieces)
    kernel = (h + 2 * hk) * c * d * pb.elem_bytes * b  # the kernel's dQ, dK, dV of a whole local block
    if comm_type == "p2p":  # K/V slots beyond the one block in flight, dK/dV slots, fp32 dQ, one piece's kernel
        return kv_w / pieces + (pieces + 1) / pieces * dkv32 + acc32 + kernel / pieces
    if comm_type == "all_gather":
        groups = max(1, min(pb.gather_head_groups, hk))
        kernel = (h + 2 * hk * world) * c * d * pb.elem_bytes * b  # one head group's queries against all shards
        return (2 * world * kv_w + world * kv_c + 2 * world * dkv32 + kernel) / groups + acc32
    if comm_type in ("a2a", "a2a+p2p"):
        n = world if comm_type == "a2a" else inner
        hs = _HeadShares(h, hk, n)
        e_q, e_kv = hs.q_max * n / h, hs.kv_local * n / hk  # the largest head slice / K/V heads vs an even share
        copies = (2 * c * h * d * pb.elem_bytes * b) * e_q + e_kv * kv_c  # head-sharded Q, O and K/V kept for bwd
        kernel = (h * e_q + 2 * e_kv * hk) * c * d * pb.elem_bytes * b  # the rank's heads of n shards
        if comm_type == "a2a":  # no ring: one block of n shards, double-buffer terms of a ring of one
            return copies + e_kv * (kv_w + 2 * dkv32) + acc32 * e_q + kernel
        return copies + e_kv * (kv_w / pieces + (pieces + 1) / pieces * dkv32) + acc32 * e_q + kernel / pieces
    raise ValueError(comm_type)


#: tie-break among predictions within TIE of the best: the simpler exchange first
PREFERENCE = ("p2p", "all_gather", "a2a", "a2a+p2p")
TIE = 0.03


def predict_all(pb: Problem, world: int, m: Machine, inner: int | None = None) -> list[dict]:
    """Predictions for every comm type that can run; the first is the pick (:func:`pick`), then cheapest first."""
    rows = sorted((predict(t, pb, world, m, inner) for t in candidate_types(pb.heads, world, inner)),
                  key=lambda r: (r["time_s"], PREFERENCE.index(r["comm_type"])))
    best = pick(rows)
    return [best] + [r for r in rows if r is not best]


def pick(rows: list[dict]) -> dict:
    """The cheapest prediction, except that a simpler type (``PREFERENCE``) predicted within ``TIE``
    (3%) of it wins: the model cannot rank near-ties, and the simpler exchange has fewer moving parts."""
    fastest = min(r["time_s"] for r in rows)
    close = [r for r in rows if r["time_s"] <= fastest * (1 + TIE)]
    return min(close, key=lambda r: PREFERENCE.index(r["comm_type"]))


def fits(pb: Problem, world: int, layers: int, comm_type: str, memory: float, reserved: float = 0.0,
         inner: int | None = None) -> bool:
    return layers * activation_bytes(pb, world) + workspace_bytes(comm_type, pb, world, inner) + reserved <= memory


def smallest_cp(pb: Problem, layers: int, memory: float, reserved: float = 0.0, max_cp: int = 4096,
                comm_type: str = "p2p") -> int | None:
    """The smallest power-of-two CP size whose per-rank attention memory fits in ``memory`` bytes."""
    p = 1
    need = get_layout(pb.layout).local_multiple()
    while p <= max_cp:
        if pb.seq % (p * need) == 0 and fits(pb, p, layers, comm_type, memory, reserved):
            return p
        p *= 2
    return None


def wire_bytes_per_elem(comm_dtype: str | None, elem_bytes: int, head_dim: int, group_tokens: int = 64) -> float:
    """K/V wire bytes per element for a ``comm_dtype`` of the wire-dtype table (``COMM_DTYPE_ALIASES``):
    as computed, the cast dtype's size, or for fp8 1 byte plus one fp32 scale per ``group_tokens`` tokens x
    head (``FP8Codec``'s default groups)."""
    wire = wire_dtype(comm_dtype)
    if wire is None:
        return float(elem_bytes)
    if wire in (torch.float8_e4m3fn, torch.float8_e5m2):
        return 1.0 + 4.0 / (group_tokens * head_dim)
    return float(wire.itemsize)

