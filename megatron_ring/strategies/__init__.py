"""Context-parallel exchange patterns behind one switch: ``ring_attention(..., comm_type=...)``.

One file per strategy; each consumes the same :class:`~megatron_ring.core.plan.RingPlan` (layout schedule,
kernel, codec) and reuses the engine's ring forward/backward for its compute:

* ``p2p`` (:mod:`.p2p`): the ring;
* ``all_gather`` (:mod:`.all_gather`): gathered K/V in pieces, dK/dV reduce-scattered;
* ``a2a`` (:mod:`.a2a`): Ulysses, sequence shards <-> head shards;
* ``a2a+p2p`` (:mod:`.a2a_p2p`): Ulysses in the inner group, ring over the outer group;
* ``auto`` (:mod:`.auto`): one of the above, chosen per call signature by :mod:`megatron_ring.planning.cost_model`.

A rank whose input is refused after the cross-rank check takes part in the forward's exchanges anyway,
so that every rank raises (:class:`Refusal`, :func:`refuse`; docs/design.md "Faults").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from megatron_ring.core.plan import RingPlan
from megatron_ring.core.engine import one_ring, refuse_on_ring
from megatron_ring.strategies import a2a, a2a_p2p, all_gather, p2p
from megatron_ring.strategies.a2a_p2p import make_hierarchical_groups
from megatron_ring.strategies.refusal import StrategyStatus
from megatron_ring.transport.groups import context

__all__ = ["STRATEGIES", "COMM_TYPES", "run_strategy", "check_comm_type", "make_hierarchical_groups", "Refusal",
           "refuse"]

STRATEGIES: dict[str, Callable[..., torch.Tensor]] = {
    "p2p": p2p.run, "all_gather": all_gather.run, "a2a": a2a.run, "a2a+p2p": a2a_p2p.run,
}
COMM_TYPES: tuple[str, ...] = (*STRATEGIES, "auto")


def check_comm_type(comm_type: Any) -> str:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown comm_type {comm_type!r}; use one of {list(COMM_TYPES)}")
    return comm_type


def hierarchical_usable(plan: RingPlan, hierarchical_groups: Any, required: bool, device: torch.device) -> bool:
    """Whether ``hierarchical_groups`` is usable on EVERY rank (one small all-gather per new groups).

    ``required`` (a2a+p2p): raise the same ValueError on every rank when any rank's groups are unusable.
    """
    ring = plan.ring
    # the group objects themselves (identity-hashed, held with the ring group's entry), never id(): a destroyed
    # group's address can be reused by a new one
    groups = tuple(hierarchical_groups) if isinstance(hierarchical_groups, (tuple, list)) else (hierarchical_groups,)
    key = (groups, required)
    agreed = context(ring.group).agreed
    if key in agreed:
        return agreed[key]
    reason = a2a_p2p.check_hierarchical_groups(ring.group, ring.world, ring.rank, hierarchical_groups)
    flags = torch.zeros(ring.world, dtype=torch.int64, device=device)
    flags[ring.rank] = int(reason is not None)
    dist.all_reduce(flags, group=ring.group)
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad and required:
        raise ValueError(reason if reason is not None else
                         f"comm_type='a2a+p2p': hierarchical_groups are unusable on group rank(s) {bad} (see "
                         f"their error); {a2a_p2p.HIER_HINT}")
    agreed[key] = not bad
    return not bad


def run_strategy(comm_type: str, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *,
                 hierarchical_groups: Any = None, sink: torch.Tensor | None = None,
                 refusal: BaseException | None = None) -> torch.Tensor:
    """BHSD views in (as :class:`~megatron_ring.core.autograd.RingAttentionFunction` takes them), output out.

    ``sink``: fp32 ``[h]`` softmax offsets (attention sinks); dropout rides in ``plan.dropout``.
    ``refusal``: this rank rejected its input (the tensors are zeros; see :func:`refuse`): run the
    forward's exchanges with a failing status so that every rank raises, then raise ``refusal``."""
    check_comm_type(comm_type)
    ring = plan.ring
    kw = dict(hierarchical_groups=hierarchical_groups, sink=sink)
    if ring.world == 1:  # one rank: every exchange pattern is the local computation
        return p2p.run(qh, kh, vh, plan, **kw)
    if ring.group is None:
        raise ValueError(f"comm_type={comm_type!r} needs a process group; a LoopbackRing (compute-only timing) "
                         "runs comm_type='p2p' only")
    if comm_type == "a2a+p2p":
        hierarchical_usable(plan, hierarchical_groups, required=True, device=qh.device)
    if comm_type == "auto":
        from megatron_ring.strategies.auto import choose  # noqa: PLC0415 - the probe and cost model load on first use

        usable = hierarchical_usable(plan, hierarchical_groups, required=False, device=qh.device)  # on every rank
        probe = dataclasses.replace(plan, row_max=None)  # its timing runs on random tensors: no max logit from them
        comm_type = choose(qh, kh, probe, hierarchical_groups if usable else None, vh, runners=STRATEGIES)
    if comm_type == "p2p":  # the ring carries its own status (core/status.py)
        if refusal is not None:
            refuse_on_ring(plan, kh, vh, refusal)
        return p2p.run(qh, kh, vh, plan, **kw)
    status = StrategyStatus(plan, refusal)
    with one_ring(plan.ring, "forward"):  # an error after its first collective leaves the group out of step
        out = STRATEGIES[comm_type](qh, kh, vh, dataclasses.replace(plan, strategy_status=status), **kw)
    return status.settle(out)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A ValueError this rank alone raised about its input after the cross-rank check, and what the
    forward's exchanges need to go on without it: the plan (ring, codec, schedule, K/V pieces) and the
    shapes of the BHSD tensors (``q`` may be None for the ring, which streams K/V only)."""

    error: BaseException
    comm_type: str
    plan: RingPlan
    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor | None = None
    hierarchical_groups: Any = None


def refuse(refusal: Refusal) -> NoReturn:
    """Take part in the forward's exchanges with a failing status, then raise ``refusal.error``; every
    other rank raises an error naming this one (:class:`~megatron_ring.errors.RingInputError`).

    The ring (``p2p``) runs its real K/V stream, zeros marked as refused
    (:func:`~megatron_ring.core.engine.refuse_on_ring`); the collective strategies run their forward on
    zeros, with the refusal as the status every rank gathers at its end (:mod:`.refusal`)."""
    r = refusal
    if r.comm_type == "p2p":
        refuse_on_ring(r.plan, r.k, r.v, r.error)
    zq, zk, zv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (r.q, r.k, r.v))
    with torch.no_grad():
        run_strategy(r.comm_type, zq, zk, zv, r.plan, hierarchical_groups=r.hierarchical_groups, refusal=r.error)
    raise r.error
