"""The context-parallel provider: registers the ring with Megatron-Core's ``parallel_state``.

Call :func:`initialize_context_parallel` once per process, after ``torch.distributed.init_process_group``
and after (or instead of) ``parallel_state.initialize_model_parallel``. It

* reuses Megatron's CP groups when model parallelism is initialised (checking that the CP size matches),
  or creates all groups with ``context_parallel_size`` otherwise;
* checks the CP group is orthogonal to TP, PP and DP (and inside DP x CP, the gradient group);
* records the ring neighbours as *global* ranks (what ``P2POp`` / ``isend`` need);
* optionally builds hierarchical sub-rings (``hierarchical_context_parallel_sizes``).

Every check depends only on values all ranks share, so a bad setting raises on every rank (no hang).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig
from megatron_ring.megatron.groups.resolve import group_ranks

__all__ = [
    "RingState",
    "initialize_context_parallel",
    "get_ring_state",
    "is_context_parallel_initialized",
    "destroy_context_parallel",
]


@dataclass(frozen=True)
class RingState:
    """The registered ring. Ranks are global ranks unless named ``*_rank`` in the group."""

    config: RingConfig
    group: Any  # torch ProcessGroup of the CP ring
    global_ranks: tuple[int, ...]  # CP group members in ring order
    rank: int  # this process's index in the CP group
    next_rank: int  # global rank this process sends K/V to
    prev_rank: int  # global rank this process receives K/V from
    dp_cp_group: Any  # gradient all-reduce group (DP x CP)
    hierarchical_groups: tuple[Any, ...] = ()  # sub-rings, innermost first
    hierarchical_ranks: tuple[tuple[int, ...], ...] = ()

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    @property
    def layout(self) -> str:
        return self.config.layout

    @property
    def comm_dtype(self) -> torch.dtype | None:
        return self.config.torch_comm_dtype


_STATE: RingState | None = None


def initialize_context_parallel(config: RingConfig | None = None, *, context_parallel_size: int | None = None,
                                tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                seq_length: int | None = None, pg_collection: Any = None,
                                **model_parallel_kwargs: Any) -> RingState:
    """Register the ring's options (and its group) and return its :class:`RingState`.

    Optional: without it, :class:`~megatron_ring.megatron.attention.RingDotProductAttention` takes the CP
    group Megatron gives it at first use and its options from ``MEGATRON_RING_*`` (:mod:`megatron_ring.megatron.env`). Call it to
    validate the options against the job and set them in code. It never creates a second set of groups:
    with ``pg_collection`` (Megatron-Bridge's decentralized process groups, ``HyperCommGrid``) its ``cp``
    (and ``dp_cp``) are used as they are; else Megatron's ``parallel_state`` groups when they exist; only
    when neither exists does it ask ``parallel_state.initialize_model_parallel`` to build them.

    Args:
        config: the ring settings (default: ``RingConfig(context_parallel_size=...)``).
        context_parallel_size: shorthand when ``config`` is not given.
        tensor_model_parallel_size, pipeline_model_parallel_size, **model_parallel_kwargs: passed to
            ``parallel_state.initialize_model_parallel`` when model parallelism is not initialised yet.
        seq_length: if given, checked against the layout's divisibility.

    Idempotent: a second call with an equal config returns the registered state.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ContextParallelConfigError: sizes do not divide the world / disagree with Megatron's groups.
    """
    global _STATE
    from megatron.core import parallel_state as ps

    if config is None:
        config = RingConfig(context_parallel_size=context_parallel_size or 1)
    elif context_parallel_size is not None and context_parallel_size != config.context_parallel_size:
        raise ContextParallelConfigError(
            "--context-parallel-size",
            f"context_parallel_size={context_parallel_size} disagrees with config ({config.context_parallel_size})")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("initialize_context_parallel() needs torch.distributed: call "
                           "torch.distributed.init_process_group(backend=...) first (torchrun sets the env)")
    _check_same_on_every_rank(config, seq_length=seq_length, tensor_model_parallel_size=tensor_model_parallel_size,
                              pipeline_model_parallel_size=pipeline_model_parallel_size)
    if _STATE is not None:
        if _STATE.config == config:
            return _STATE
        raise RuntimeError(f"context parallelism is already initialised with {_STATE.config}; call "
                           f"destroy_context_parallel() before re-initialising with {config}")

    cp = config.context_parallel_size
    world = dist.get_world_size()
    if pg_collection is not None:
        return _register_collection(config, pg_collection, seq_length)
    if ps.model_parallel_is_initialized():
        have = ps.get_context_parallel_world_size()
        if have != cp:
            raise ContextParallelConfigError(
                "--context-parallel-size",
                f"Megatron's parallel_state was initialised with context_parallel_size={have}, but the ring "
                f"config asks for {cp}; pass the same --context-parallel-size to both")
        config.validate(world_size=world, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                        seq_length=seq_length)
    else:
        config.validate(world_size=world, tensor_model_parallel_size=tensor_model_parallel_size,
                        pipeline_model_parallel_size=pipeline_model_parallel_size, seq_length=seq_length)
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                     pipeline_model_parallel_size=pipeline_model_parallel_size,
                                     context_parallel_size=cp, **model_parallel_kwargs)

    group = ps.get_context_parallel_group()
    ranks = group_ranks(group)
    me = dist.get_rank()
    _check_orthogonal(ps, me, ranks)
    r = ranks.index(me)
    hgroups, hranks = _build_hierarchical(ranks, config.hierarchical_context_parallel_sizes)
    _STATE = RingState(
        config=config,
        group=group,
        global_ranks=ranks,
        rank=r,
        next_rank=ranks[(r + 1) % len(ranks)],
        prev_rank=ranks[(r - 1) % len(ranks)],
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        hierarchical_groups=hgroups,
        hierarchical_ranks=hranks,
    )
    return _STATE


def _register_collection(config: RingConfig, pg_collection: Any, seq_length: int | None) -> RingState:
    """Register the ring on ``pg_collection.cp`` (no group is created)."""
    global _STATE
    group = getattr(pg_collection, "cp", None)
    if group is None:
        raise ContextParallelConfigError("--context-parallel-size", "pg_collection has no 'cp' group; build the "
                                                                    "collection with a CP dimension")
    ranks = group_ranks(group)
    if len(ranks) != config.context_parallel_size:
        raise ContextParallelConfigError(
            "--context-parallel-size", f"pg_collection.cp has {len(ranks)} ranks but the ring config asks for "
                                       f"{config.context_parallel_size}; pass the same --context-parallel-size")
    tp = getattr(pg_collection, "tp", None)
    pp = getattr(pg_collection, "pp", None)
    config.validate(world_size=dist.get_world_size(), tensor_model_parallel_size=tp.size() if tp is not None else 1,
                    pipeline_model_parallel_size=pp.size() if pp is not None else 1, seq_length=seq_length)
    me = dist.get_rank()
    r = ranks.index(me)
    hgroups, hranks = _build_hierarchical(ranks, config.hierarchical_context_parallel_sizes)
    _STATE = RingState(config=config, group=group, global_ranks=ranks, rank=r,
                       next_rank=ranks[(r + 1) % len(ranks)], prev_rank=ranks[(r - 1) % len(ranks)],
                       dp_cp_group=getattr(pg_collection, "dp_cp", None), hierarchical_groups=hgroups,
                       hierarchical_ranks=hranks)
    return _STATE


_FLAGS = {"context_parallel_size": "--context-parallel-size", "layout": "--cp-layout",
          "comm_dtype": "--cp-comm-dtype", "cp_comm_type": "--cp-comm-type",
          "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes",
          "seq_length": "--seq-length", "tensor_model_parallel_size": "--tensor-model-parallel-size",
          "pipeline_model_parallel_size": "--pipeline-model-parallel-size"}


def _check_same_on_every_rank(config: RingConfig, **sizes: Any) -> None:
    """Raise the same ContextParallelConfigError on every rank if any rank was configured differently.

    One ``all_gather_object`` at start-up, before anything a mismatch could make diverge (a hang later).
    """
    mine = {name: getattr(config, name) for name in _FLAGS if hasattr(config, name)}
    mine.update(sizes)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for name, flag in _FLAGS.items():
        values = [theirs.get(name) for theirs in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ContextParallelConfigError(
                flag, f"ranks were launched with different values ({per_rank}); every rank must get the "
                      "same arguments")


def _check_orthogonal(ps: Any, me: int, cp_ranks: tuple[int, ...]) -> None:
    """Every rank's CP group meets its TP, PP and DP groups only in itself and lies inside DP x CP."""
    cp = set(cp_ranks)
    for name, group in (("tensor", ps.get_tensor_model_parallel_group()),
                        ("pipeline", ps.get_pipeline_model_parallel_group()),
                        ("data", ps.get_data_parallel_group(with_context_parallel=False))):
        other = set(group_ranks(group))
        if cp & other != {me}:
            raise RuntimeError(f"context-parallel group {sorted(cp)} is not orthogonal to the {name}-parallel "
                               f"group {sorted(other)} of rank {me}; check the rank order "
                               "(order= of initialize_model_parallel)")
    dpcp = set(group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    dp = ps.get_data_parallel_world_size(with_context_parallel=False)
    if not cp <= dpcp or len(dpcp) != dp * len(cp):
        raise RuntimeError(f"the DP x CP gradient group {sorted(dpcp)} of rank {me} does not contain the "
                           f"context-parallel group {sorted(cp)} times the data-parallel size {dp}")


def _build_hierarchical(ranks: tuple[int, ...], sizes: tuple[int, ...] | None
                        ) -> tuple[tuple[Any, ...], tuple[tuple[int, ...], ...]]:
    """Sub-rings of the CP group, level 0 innermost (consecutive ranks), like Megatron's hierarchy.

    ``new_group`` is collective over the whole world, so every rank creates every CP group's sub-groups
    in one agreed order (the CP groups are exchanged with ``all_gather_object``).
    """
    if not sizes or len(sizes) < 2:
        return (), ()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ranks)
    all_cp = sorted({tuple(g) for g in gathered})
    mine_groups: list[Any] = []
    mine_ranks: list[tuple[int, ...]] = []
    me = dist.get_rank()
    for level, size in enumerate(sizes):
        inner = math.prod(sizes[:level])  # stride between members at this level
        for cp_ranks in all_cp:
            n = len(cp_ranks)
            for start in range(n):
                # members: start, start+inner, ... ; each sub-group is listed once (from its smallest index)
                if (start // inner) % size != 0:
                    continue
                members = tuple(cp_ranks[start + j * inner] for j in range(size))
                g = dist.new_group(list(members))
                if me in members:
                    mine_groups.append(g)
                    mine_ranks.append(members)
    return tuple(mine_groups), tuple(mine_ranks)


def get_ring_state() -> RingState:
    """The registered ring; raises if :func:`initialize_context_parallel` has not been called."""
    if _STATE is None:
        raise RuntimeError("context parallelism is not initialised: call "
                           "megatron_ring.megatron.initialize_context_parallel(config) after "
                           "torch.distributed.init_process_group")
    return _STATE


def is_context_parallel_initialized() -> bool:
    """Whether :func:`initialize_context_parallel` has registered a ring in this process."""
    return _STATE is not None


def destroy_context_parallel(destroy_model_parallel: bool = False) -> None:
    """Forget the registered ring (and, if asked, Megatron's groups too)."""
    global _STATE
    _STATE = None
    if destroy_model_parallel:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
