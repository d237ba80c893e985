"""Our dynamic-CP scheduler in Megatron's hybrid-CP data path.

The seam: megatron-core's ``HybridCPDataLoaderWrapper`` (``megatron/core/datasets/data_schedule.py``)
gathers the document lengths of the global batch over DP, then calls
``self.cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, config)`` -- a
``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``) -- and reroutes the
documents by its answer. That answer, per round (Megatron calls them "groups"; a DP x CP barrier follows
each), per DP x CP rank, is the list of document lengths and the list of document ids the rank runs; a
document's CP size is the number of ranks listing it in that round, and its process group is
``parallel_state.get_hybrid_data_context_parallel_groups(group_size=...)``: the aligned block of that
power-of-two size around the rank.

:class:`RingCPScheduler` answers the same call with :func:`megatron_ring.schedule_dynamic_cp`, restricted
to what that data path can run: power-of-two group sizes aligned to their size (exactly the groups
``parallel_state`` builds), one document per sub-sample (the wrapper moves and runs documents one by one),
and one round (our schedule needs no barrier: every rank runs its documents in one global order).
:func:`use_ring_scheduler` swaps it into an existing wrapper. The per-document group itself must be honoured
by the attention (``packed_seq_params.cp_group`` / ``local_cp_size``: issue 21 point 1).
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron_ring import Machine, Problem, schedule_dynamic_cp

__all__ = ["RingCPScheduler", "use_ring_scheduler", "to_megatron_groups"]

#: machine numbers when none are given (an H100-class GPU; replace with measured ones)
DEFAULT_MACHINE = Machine(flops=400e12, bw_intra=300e9, bw_inter=50e9, gpus_per_node=8, latency=20e-6,
                          call_overhead=20e-6)


def to_megatron_groups(sched: "megatron_ring.planning.dynamic_cp.DynamicCPSchedule", ids: Sequence[int]) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """(groups, sample_id_groups) in ``BalancedCPScheduler.get_groups_and_subsamples``'s shape: per round,
    per rank, the lengths and the ids (``ids[doc]``) of the documents the rank runs, in its run order."""
    groups, id_groups = [], []
    for rnd in sched.rounds:
        lens = [[] for _ in range(sched.world)]
        gids = [[] for _ in range(sched.world)]
        for sub in rnd:
            for d, n in zip(sub.docs, sub.lengths):
                for r in sub.ranks:
                    lens[r].append(n)
                    gids[r].append(ids[d])
        groups.append(lens)
        id_groups.append(gids)
    return groups, id_groups


class RingCPScheduler:
    """Drop-in for megatron-core's ``BalancedCPScheduler`` (same constructor and
    ``get_groups_and_subsamples``), scheduling with our cost model.

    ``problem``: the attention shape per tensor-parallel rank (heads, K/V heads, head dim, dtype bytes,
    layout); ``machine``: measured machine numbers (default :data:`DEFAULT_MACHINE`)."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: Any, *, problem: Problem | None = None,
                 machine: Machine | None = None, seed: int = 0) -> None:
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.total_hdp_gpus = dp_cp_group.size() if hasattr(dp_cp_group, "size") else int(dp_cp_group)
        self.problem = problem or Problem(batch=1, seq=0, heads=32, kv_heads=8, head_dim=128)
        self.machine = machine or DEFAULT_MACHINE
        self.seed = seed
        self.last_schedule = None  # the latest megatron_ring.planning.dynamic_cp.DynamicCPSchedule

    def get_groups_and_subsamples(self, sample_id_seqlens, config=None):
        ids = [int(i) for i, _ in sample_id_seqlens]
        lens = [int(n) for _, n in sample_id_seqlens]
        sched = schedule_dynamic_cp(lens, self.total_hdp_gpus, self.problem, self.machine,
                                    max_tokens_per_rank=self.max_seq_len_per_rank, sizes="pow2", aligned=True,
                                    pack=False, seed=self.seed)
        self.last_schedule = sched
        return to_megatron_groups(sched, ids)


def use_ring_scheduler(wrapper: Any, *, problem: Problem | None = None, machine: Machine | None = None,
                       seed: int = 0) -> Any:
    """Replace the ``BalancedCPScheduler`` of a megatron-core ``HybridCPDataLoaderWrapper`` with
    :class:`RingCPScheduler` (same cap, same DP x CP group); returns the wrapper."""
    old = wrapper.cp_balancing_scheduler
    wrapper.cp_balancing_scheduler = RingCPScheduler(old.max_seq_len_per_rank, wrapper.dp_cp_group, problem=problem,
                                                     machine=machine, seed=seed)
    return wrapper
