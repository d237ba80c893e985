"""Which process group a ring-attention call runs on, and what is kept per group.

* :func:`per_call_group`: the group a call brings in ``packed_seq_params`` (Megatron's hybrid / dynamic
  context parallelism: ``cp_group``, ``local_cp_size``; ``local_cp_size == 1`` without a group means
  "no CP for this micro-batch", like TransformerEngine's attention reads it).
* :func:`default_cp_group`: the group of a call that names none (batch split, loss): the registered ring's,
  else ``parallel_state``'s; :func:`hybrid_cp_group`: the group of one hybrid-CP document.
* :func:`model_group`: the model's CP group, looked up at each call (``pg_collection.cp``, else the
  registered ring's group, else ``parallel_state``'s), so a model follows Megatron when it replaces the
  groups on live modules (Megatron-Bridge's eval-time CP rebinding).

Per-group facts (global ranks) are kept in a ``WeakKeyDictionary`` keyed on the group object: an entry
lives as long as its group, so a run that meets many groups keeps no stale entries. The one-rank group
used for ``local_cp_size == 1`` is created once per process, with only this rank taking part
(``use_local_synchronization``: no collective over the world).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch.distributed as dist

from megatron_ring.megatron.config import ContextParallelConfigError

__all__ = ["per_call_group", "model_group", "default_cp_group", "hybrid_cp_group", "same_ranks", "group_ranks",
           "single_rank_group"]

_RANKS: "weakref.WeakKeyDictionary[Any, tuple[int, ...]]" = weakref.WeakKeyDictionary()
_SINGLE: dict[int, Any] = {}  # this process's one-rank group, by global rank
_LOCK = threading.Lock()


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` in group order (cached per group object, released with it)."""
    try:
        return _RANKS[group]
    except (KeyError, TypeError):
        ranks = tuple(dist.get_process_group_ranks(group))
        try:
            _RANKS[group] = ranks
        except TypeError:  # an object without weak references: no cache
            pass
        return ranks


def same_ranks(group: Any, state: Any) -> bool:
    """Whether ``group`` has the registered ring's members (in its order)."""
    return group is not None and (group is state.group or group_ranks(group) == tuple(state.global_ranks))


def single_rank_group() -> Any:
    """A process group holding only this rank (None when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me = dist.get_rank()
    with _LOCK:
        if me not in _SINGLE:
            _SINGLE[me] = dist.new_group([me], use_local_synchronization=True)
        return _SINGLE[me]


def per_call_group(params: Any) -> tuple[bool, Any]:
    """``(True, group)`` when ``packed_seq_params`` names this call's group, else ``(False, None)``.

    ``group`` is None for ``local_cp_size == 1`` when torch.distributed is not initialised (one process)."""
    if params is None:
        return False, None
    group = getattr(params, "cp_group", None)
    size = getattr(params, "local_cp_size", None)
    if size is not None:
        size = int(size.item()) if hasattr(size, "item") else int(size)
    if group is not None:
        if size is not None and size != group.size():
            raise ContextParallelConfigError(
                "--hybrid-context-parallel", f"packed_seq_params.local_cp_size={size} but packed_seq_params.cp_group "
                                             f"has {group.size()} ranks; they must agree")
        return True, group
    if size is None:
        return False, None
    if size != 1:
        raise ContextParallelConfigError(
            "--hybrid-context-parallel", f"packed_seq_params.local_cp_size={size} without a cp_group; give the "
                                         "group (packed_seq_params.cp_group) or local_cp_size=1 (no CP)")
    return True, single_rank_group()


def model_group(pg_collection: Any, state: Any) -> Any:
    """The model's CP group now: ``pg_collection.cp``, the registered ring's, or ``parallel_state``'s.

    Returns a one-rank group when none is known and the model is not context parallel (None when
    torch.distributed is not initialised)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and state is not None:
        group = state.group
    if group is None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            group = ps.get_context_parallel_group(check_initialized=False)
    if group is None:
        group = single_rank_group()
    return group


def default_cp_group(state: Any = None) -> Any:
    """The CP group when a caller names none: the registered ring's (``state``), else ``parallel_state``'s.
    Raises (naming the fix) when neither exists."""
    if state is not None:
        return state.group
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("no context-parallel group: call initialize_context_parallel() (or Megatron's "
                           "initialize_model_parallel) first, or pass the group")
    return ps.get_context_parallel_group()


def hybrid_cp_group(local_cp_size: int) -> Any:
    """The DP x CP group of ``local_cp_size`` ranks this rank belongs to in Megatron's hybrid CP (None for 1)."""
    if local_cp_size == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_hybrid_data_context_parallel_groups(group_size=local_cp_size)
