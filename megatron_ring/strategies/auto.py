"""``comm_type="auto"``: the cheapest comm type by the cost model, chosen once per call signature (shapes, dtype,
causality, the layout's family, wire, pieces, groups: not the documents, nor a layout made from them, which a packed
batch brings anew in every micro-batch).

Machine numbers (F, B, latency) come from, in order: environment variables (production clusters:
``MEGATRON_RING_FLOPS``, ``MEGATRON_RING_BWD_FLOPS``, ``MEGATRON_RING_BANDWIDTH``,
``MEGATRON_RING_INTER_BANDWIDTH``, ``MEGATRON_RING_LATENCY_S``, ``MEGATRON_RING_CALL_OVERHEAD_S``,
``MEGATRON_RING_GPUS_PER_NODE``, ``MEGATRON_RING_OVERLAP``), or
:func:`set_machine`, or a short probe run once per (group, device type): the kernel's forward and
backward rate on one block and a ring exchange of a small and a large message (bandwidth measured on
the outer group too when hierarchical groups are given). Every rank must choose the same type (else the
ranks would run different collectives and hang), so the numbers are agreed before use: rates are
all-reduced with MIN and the latency with MAX over the group, and the choice depends only on them and on
the call's shapes (which the consistency check has already made equal).

Measured tie-break: the model ranks types well when their costs differ by more than its error (on GPU
clusters: bytes vs compute), but not near-ties. Where every type is compute-bound (a CPU with gloo, where
the types move a few MB against seconds of compute) its predictions sit within a few percent of each
other while the measured times differ by 10-30% for reasons it does not model (kernel shapes, copies,
how P processes share fewer cores). So when more than one candidate is predicted within ``BAND`` (30%)
of the best and the best is predicted to take at least ``MEASURE_MIN_S`` (0.05 s: below that the choice
hardly matters), and timing them in at least 3 rounds fits in ``MEASURE_BUDGET_S`` (400 s of predicted
time), ``auto`` runs each of those candidates forward+backward on random tensors of the call's shapes and
strides, in ``MEASURE_ROUNDS`` (5; 3 or 4 when the budget allows no more) interleaved rounds, takes each
one's MEDIAN round (a best-of-two picks the luckiest call: at P=4 S=32768 it ranked a type 7.5% behind
first), agrees on the times (MAX over the group) and picks the
fastest measured, except that a simpler type (p2p, all_gather, a2a, a2a+p2p in that order) wins when
it is within the tie: the larger of 3% and the measurement's own noise (the rounds' relative spread
over sqrt(rounds)). One call on a shared CPU varies by +-15% while the types differ by 0-10%, so a gap
smaller than the noise is not a reason to leave the simpler type. It
costs a few calls' time once per signature. Environment: ``MEGATRON_RING_AUTO_MEASURE=0`` turns it off
(model only); ``MEGATRON_RING_AUTO_BAND``, ``MEGATRON_RING_AUTO_MEASURE_MIN_S``,
``MEGATRON_RING_AUTO_MEASURE_BUDGET_S``, ``MEGATRON_RING_AUTO_MEASURE_ROUNDS`` tune it.

The choice, the predicted costs of every candidate and the measured times (when measured) are logged
once per signature at INFO level on logger ``megatron_ring``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring import settings
from megatron_ring.timing import median_seconds, seconds, sync_device
from megatron_ring.transport import groups
from megatron_ring.wire.codecs import KVSpec
from megatron_ring.transport.ring import Ring
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.views import memory_order
from megatron_ring.core.rotation import divisor_at_most
from megatron_ring.schedules.layouts import LAYOUTS
from megatron_ring.planning.cost_model import PREFERENCE, TIE, Machine, Problem, predict_all
from megatron_ring.strategies import all_gather

__all__ = ["choose", "set_machine", "machine_for", "probe_machine", "measure", "to_measure", "last_choice"]

log = logging.getLogger("megatron_ring")

# Machines and choices are kept in each group's context (transport/groups.py: ``machines``, ``choices``);
# a machine set for group None is the one of every group.
last_choice: dict[str, Any] = {}  # the latest choice made: key, predicted, measured, choice (benchmark, tests)


def set_machine(machine: Machine | None, group: Any = None, device_type: str | None = None) -> None:
    """Use ``machine`` for ``auto`` (all groups/devices if not given); None forgets every setting and choice."""
    if machine is None:
        for _, ctx in groups.contexts():
            ctx.machines.clear()
            ctx.choices.clear()
        return
    groups.context(group).machines[("set", device_type)] = machine


def inputs_key(group: Any, device_type: str) -> str:
    """What this rank's ``auto`` decides from besides the call (the ``MEGATRON_RING_*`` variables it reads, a
    machine given to :func:`set_machine` for this group or all), as text for the call's cross-rank check: ranks
    that differ would probe and choose differently (mismatched collectives); they get the named error instead."""
    set_here = [f"{key[1] or 'any device'}: {m}" for ctx in (groups.context(group), groups.context(None))
                for key, m in ctx.machines.items() if key[0] == "set" and key[1] in (None, device_type)]
    env = ", ".join(f"{k}={v}" for k, v in settings.auto_inputs())
    return "auto" + (f" [{env}]" if env else "") + (f" [set_machine {'; '.join(set_here)}]" if set_here else "")


def _kernel_times(kern, device, dtype, h: int, s: int, d: int) -> tuple[float, float]:
    q, k, v = (torch.randn(1, h, s, d, device=device, dtype=dtype) for _ in range(3))
    o, lse = kern.forward(q, k, v, False, d ** -0.5)

    def fwd():
        kern.forward(q, k, v, False, d ** -0.5)
        sync_device(device)

    def bwd():
        kern.backward(o, q, k, v, o, lse, False, d ** -0.5)
        sync_device(device)
    return median_seconds(fwd), median_seconds(bwd)


def probe_machine(plan: RingPlan, device: torch.device, dtype: torch.dtype, outer: Any = None, heads: int = 4,
                  head_dim: int = 64, block: int = 256) -> dict[str, float]:
    """This rank's measured numbers (not yet agreed across ranks): flops, bwd_flops, call_overhead,
    bw_intra, bw_inter, latency. The kernel is timed at the call's head count/dim and a block of the
    call's chunk size (capped), and on a tiny block for the per-task overhead."""
    kern = plan.kernel
    tf0, tb0 = _kernel_times(kern, device, dtype, heads, 8, head_dim)  # ~pure overhead
    tf, tb = _kernel_times(kern, device, dtype, heads, block, head_dim)
    flop = 4 * heads * block * block * head_dim
    out = {"flops": flop / max(tf - tf0, 1e-9), "bwd_flops": 2.5 * flop / max(tb - tb0, 1e-9),
           "call_overhead": tf0}

    def link(ring: Ring, nbytes: int) -> float:
        send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        dist.barrier(group=ring.group)

        def go():
            ring.exchange(send, recv, "fwd_kv", 0).wait()
            sync_device(device)
        return median_seconds(go)
    small, large = 1 << 10, 1 << 22
    ring = Ring(plan.ring.group, device, None)  # its own byte counters: the caller's stay clean
    t_small, t_large = link(ring, small), link(ring, large)
    # B from the large message alone (its latency share is small; a difference of two noisy times is not)
    out["latency"] = t_small
    out["bw_intra"] = out["bw_inter"] = large / t_large
    if outer is not None:
        oring = Ring(outer, device, None)
        if oring.world > 1:
            out["bw_inter"] = large / link(oring, large)
    return out


def _probe_block(local_len: int) -> int:
    """Probe block size: the chunk a task typically covers (half the local length), within [64, 1024]."""
    return max(64, min(1024, local_len // 2))


def machine_for(plan: RingPlan, device: torch.device, dtype: torch.dtype, outer: Any = None, heads: int = 4,
                head_dim: int = 64, local_len: int = 512) -> Machine:
    """The agreed :class:`Machine` for this group, device and kernel shape (probed once, then cached)."""
    group = plan.ring.group
    machines, every = groups.context(group).machines, groups.context(None).machines
    for table, key in ((machines, ("set", device.type)), (machines, ("set", None)), (every, ("set", device.type)),
                       (every, ("set", None))):
        if key in table:
            return table[key]
    block = _probe_block(local_len)
    key = ("probed", device.type, outer, dtype, min(heads, 8), head_dim, block)  # outer: the group itself
    if key in machines:
        return machines[key]
    env = settings.machine_numbers()
    numbers = env if len(env) == len(settings.MACHINE_VARIABLES) else {
        **probe_machine(plan, device, dtype, outer, min(heads, 8), head_dim, block), **env}
    order = ["flops", "bwd_flops", "bw_intra", "bw_inter", "latency", "call_overhead"]
    # agree: MIN of rates, MAX of times (as -MIN of -time) over the group
    times = ("latency", "call_overhead")
    vec = torch.tensor([-numbers[n] if n in times else numbers[n] for n in order], dtype=torch.float64,
                       device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
    agreed = {n: (-x if n in times else x) for n, x in zip(order, vec.tolist())}
    overlap = settings.overlap()  # unset: none on CPU (transfers run on the compute cores), full on GPUs
    machine = machines[key] = Machine(
        flops=agreed["flops"], bwd_flops=agreed["bwd_flops"], bw_intra=agreed["bw_intra"], bw_inter=agreed["bw_inter"],
        latency=agreed["latency"], call_overhead=agreed["call_overhead"], gpus_per_node=settings.gpus_per_node(),
        overlap=overlap if overlap is not None else (0.0 if device.type == "cpu" else 1.0))
    return machine


def _modelled(layout):
    """The layout the cost model predicts from, by name where it is a built-in one: it does not model documents
    (:attr:`~megatron_ring.schedules.layouts.Layout.without_documents`)."""
    layout = layout.without_documents
    return layout.name if layout.name in LAYOUTS else layout


def _problem(qh: torch.Tensor, kh: torch.Tensor, plan: RingPlan) -> Problem:
    b, h, s, d = qh.shape
    world = plan.ring.world
    hk = kh.shape[1]
    spec = KVSpec((b, hk, s, d), (b, hk, s, d), kh.dtype, torch.device("meta"))
    wire = plan.codec.wire_bytes(spec) / (2 * b * hk * s * d)
    return Problem(batch=b, seq=s * world, heads=h, kv_heads=hk, head_dim=d, causal=plan.causal,
                   layout=_modelled(plan.layout), elem_bytes=qh.element_size(), wire_bytes=wire,
                   gather_head_groups=all_gather.GROUPS,
                   kv_pieces=1 if world == 1 else divisor_at_most(hk, plan.pieces))


BAND, MEASURE_MIN_S, MEASURE_BUDGET_S, MEASURE_ROUNDS = 0.3, 0.05, 400.0, 5


def to_measure(rows: list[dict]) -> tuple[list[str], int]:
    """The candidates the model cannot tell apart and the rounds to time them (fewer when the budget is
    tight, but at least 3: fewer rounds cannot tell a type's typical time from a lucky call); ``([], 0)``
    when the model decides (see the module doc)."""
    if not settings.auto_measure():
        return [], 0
    best = min(r["time_s"] for r in rows)
    near = [r for r in rows if r["time_s"] <= best * (1 + settings.auto_number("BAND", BAND))]
    cost = sum(r["time_s"] for r in near)
    wanted = int(settings.auto_number("MEASURE_ROUNDS", MEASURE_ROUNDS))
    rounds = min(wanted, int(settings.auto_number("MEASURE_BUDGET_S", MEASURE_BUDGET_S) // max(cost, 1e-12)))
    if len(near) < 2 or rounds < max(1, min(3, wanted)) or best < settings.auto_number("MEASURE_MIN_S", MEASURE_MIN_S):
        return [], 0
    return [r["comm_type"] for r in near], rounds


def measure(candidates: list[str], qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan,
            hierarchical_groups: Any, rounds: int,
            runners: dict[str, Callable[..., torch.Tensor]]) -> tuple[dict[str, float], float]:
    """Forward+backward seconds of each candidate on random tensors of the call's shapes and strides
    (``rounds`` interleaved rounds; each one's median round, the mean when ``rounds`` <= 2; MAX over the
    group: the same numbers on every rank), and the measurement's own relative uncertainty (:func:`noise`,
    MAX over the group). ``runners``: comm type -> strategy function (the registry passes itself)."""
    dev = qh.device
    q, k, v = (torch.randn_like(t).requires_grad_() for t in (qh, kh, vh))  # the call's strides too
    # the output gradient arrives with the output's strides, which follow q's (bshd callers: a transposed view)
    order = memory_order(qh)
    shape = (*qh.shape[:3], vh.shape[-1])
    dout = torch.randn([shape[i] for i in order], dtype=qh.dtype, device=dev).permute(
        *[order.index(i) for i in range(qh.dim())])
    times: dict[str, list[float]] = {ct: [] for ct in candidates}
    kw = dict(hierarchical_groups=hierarchical_groups)
    with torch.enable_grad():  # also when the call itself runs without gradients
        _rounds(candidates, q, k, v, dout, plan, kw, rounds, times, runners)
    agreed = torch.tensor([typical(times[ct]) for ct in candidates] + [noise(times)], dtype=torch.float64,
                          device=dev)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=plan.ring.group)
    *typicals, spread = agreed.tolist()
    return dict(zip(candidates, typicals)), spread


def _rounds(candidates, q, k, v, dout, plan, kw, rounds, times, runners) -> None:
    for _ in range(rounds):
        for ct in candidates:
            def call(ct=ct):
                runners[ct](q, k, v, plan, **kw).backward(dout)
                sync_device(q.device)
            times[ct].append(seconds(call, before=lambda: (dist.barrier(group=plan.ring.group), sync_device(q.device))))
            q.grad = k.grad = v.grad = None


def typical(times: list[float]) -> float:
    """A candidate's time from its rounds: the median (the mean of one or two)."""
    return sum(times) / len(times) if len(times) <= 2 else sorted(times)[len(times) // 2]


def noise(times: dict[str, list[float]]) -> float:
    """Relative uncertainty of a :func:`typical` time: the rounds' relative spread (interquartile from 4
    rounds, else max - min) over sqrt(rounds), the median over candidates. 0 for a single round."""
    spreads = []
    for ts in times.values():
        ts = sorted(ts)
        cut = len(ts) // 4
        spreads.append((ts[-1 - cut] - ts[cut]) / typical(ts) / len(ts) ** 0.5)
    return sorted(spreads)[len(spreads) // 2] if spreads else 0.0


def _fastest(times: dict[str, float], tie: float = TIE) -> str:
    """The fastest measured, a simpler type (``PREFERENCE``) winning ties within ``tie``."""
    fastest = min(times.values())
    return min((ct for ct, t in times.items() if t <= fastest * (1 + tie)), key=PREFERENCE.index)


def choose(qh: torch.Tensor, kh: torch.Tensor, plan: RingPlan, hierarchical_groups: Any,
           vh: torch.Tensor | None = None, *, runners: dict[str, Callable[..., torch.Tensor]]) -> str:
    """The comm type for this call (cached per signature and group); the same on every rank. ``runners``:
    the strategies to time (comm type -> function), passed by the registry."""
    inner = outer = None
    if hierarchical_groups is not None:
        inner_g, outer = hierarchical_groups
        inner = dist.get_world_size(inner_g)
    # the layout's family, not its name: Megatron's per-document zigzag is a new layout in every micro-batch
    key = (tuple(qh.shape), tuple(kh.shape), qh.dtype, qh.device.type, plan.causal, plan.layout.family,
           plan.codec.name, plan.pieces, inner, outer)  # outer: the group itself, not its id
    choices = groups.context(plan.ring.group).choices
    if key in choices:
        return choices[key]
    machine = machine_for(plan, qh.device, qh.dtype, outer, qh.shape[1], qh.shape[3], qh.shape[2])
    pb = _problem(qh, kh, plan)
    rows = predict_all(pb, plan.ring.world, machine, inner)
    choice = choices[key] = rows[0]["comm_type"]
    near, rounds = to_measure(rows)
    measured, tie = {}, TIE
    if near:
        measured, spread = measure(near, qh, kh, vh if vh is not None else kh, plan,
                                   hierarchical_groups, rounds, runners)
        tie = max(TIE, spread)
        choice = _fastest(measured, tie)
    choices[key] = choice
    log.info("megatron_ring auto comm_type: chose %s for S=%d b=%d h=%d h_kv=%d d=%d %s causal=%s wire=%s over %d "
             "ranks%s; predicted fwd+bwd per call: %s (machine: F=%.3g flop/s, B=%.3g B/s, latency=%.3g s)%s",
             choice, pb.seq, pb.batch, pb.heads, pb.kv_heads, pb.head_dim, pb.layout, pb.causal,
             plan.codec.name, plan.ring.world, f" (hierarchical {inner}x{plan.ring.world // inner})" if inner else "",
             ", ".join(f"{r['comm_type']} {r['time_s'] * 1e3:.3g} ms" for r in rows),
             machine.flops, machine.bw_intra, machine.latency,
             ("; near-tie, measured: " + ", ".join(f"{ct} {t * 1e3:.3g} ms" for ct, t in measured.items())
              + f" (a simpler type wins within {tie:.1%}, the larger of 3% and the measurement's noise)")
             if measured else "")
    last_choice.update(key=key, predicted={r["comm_type"]: r["time_s"] for r in rows}, measured=measured,
                       tie=tie, choice=choice)
    return choice
