"""Sequence layouts: which global tokens a rank holds, and which block pairs a ring step computes.

A layout answers two questions for a group of ``P`` ranks and a global length ``S``:

* :meth:`Layout.positions` — the global token positions held by rank ``r`` (in local order);
* :meth:`Layout.block_tasks` — when rank ``r`` (queries) meets the K/V block of rank ``src``, which
  (query rows, key rows) sub-blocks must be computed, and whether each needs a top-left causal mask.

The ring engine only consumes a :class:`Schedule` (``block_tasks`` and ``positions``); adding a layout
never touches the engine. Each task says what kind of kernel call it is (:class:`TaskKind`). Every task is
chosen so that no query row in it is fully masked (the CPU flash kernel returns lse=0, not -inf, for such
rows), and sub-blocks that the global causal mask hides entirely are simply not listed (skipped).
``tests/test_layouts.py`` checks every task list against the mask built from ``positions``.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["BlockTask", "TaskKind", "Schedule", "Layout", "ShardView", "get_layout", "LAYOUTS"]


class TaskKind(enum.Enum):
    """What a :class:`BlockTask` asks of the kernel."""

    FULL = "full"  # every pair visible
    CAUSAL = "causal"  # top-left causal triangle (key j visible to query i iff j <= i)
    REVERSED = "reversed"  # upper triangle (key j >= query i): causal on reversed rows, run unmasked
    MASKED = "masked"  # an explicit mask (documents, window edges)


@dataclass(frozen=True)
class BlockTask:
    """One kernel call: local query rows ``q`` against visiting key rows ``kv``.

    ``causal`` means the top-left causal mask inside the sub-block (key j visible to query i iff j <= i).
    Tasks with an explicit mask are :class:`~megatron_ring.schedules.masks.MaskedTask`.
    """

    q: slice
    kv: slice
    causal: bool

    @property
    def kind(self) -> TaskKind:
        return TaskKind.CAUSAL if self.causal else TaskKind.FULL

    def explicit_mask(self) -> Any:
        """The task's :class:`~megatron_ring.schedules.masks.BlockMask`, or None (plain tasks)."""
        return None


@runtime_checkable
class Schedule(Protocol):
    """What the engine consumes: which sub-blocks a ring step computes, and where tokens sit.

    Implemented by the layouts (:class:`Layout`) and the strategies' views of several shards
    (:mod:`.views`); documents and windows add tasks with masks through :func:`..masks.schedule`."""

    name: str

    def block_tasks(self, causal: bool, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        ...

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        ...


def _all(n: int) -> slice:
    return slice(0, n)


class Layout(abc.ABC):
    """How a global sequence of length S is split over P ranks."""

    name: str = "abstract"

    @property
    def family(self) -> str:
        """What this layout is apart from the batch it was made from: its name, but one for every layout made from a
        batch's documents (:class:`~.masks.DocumentZigzag`: a new one each micro-batch). What is decided once per kind
        of call keys on it (``comm_type="auto"``'s choice), so new documents do not decide it again."""
        return self.name

    @property
    def without_documents(self) -> "Layout":
        """The layout this one is when the whole sequence is one document: itself, but the zigzag for Megatron's
        per-document zigzag (:class:`~.masks.DocumentZigzag`). The cost model predicts from it: it does not model
        documents, and a layout made from them would have it schedule every pair of ranks' tiles over the batch's
        boundaries (seconds, P = 8 at 8K tokens per rank) for a choice made once per run (``family``)."""
        return self

    @abc.abstractmethod
    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        """Global positions (int64, ``[S/P]``) of the tokens rank ``rank`` holds, in local order."""

    @abc.abstractmethod
    def local_multiple(self) -> int:
        """The local length must be a multiple of this (global length: of ``world *`` this)."""

    @abc.abstractmethod
    def causal_tasks(self, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        """Tasks for the global causal mask; ``s`` is the local length (same on every rank)."""

    def block_tasks(self, causal: bool, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        """The sub-blocks rank ``rank`` computes against the K/V block that came from rank ``src``."""
        if not causal:
            return (BlockTask(_all(s), _all(s), False),)
        return self.causal_tasks(world, rank, src, s)

    def check_local_len(self, s_local: int, world: int) -> None:
        """Raise a ValueError naming the fix if a local length cannot come from this layout."""
        m = self.local_multiple()
        if s_local <= 0 or s_local % m:
            raise ValueError(
                f"layout='{self.name}' needs the local sequence length to be a multiple of {m} "
                f"(global length divisible by {m * world} for {world} ranks), got s_local={s_local}; "
                f"pad the sequence to a multiple of {m * world}"
                + (" or use layout='striped'" if self.name != "striped" else "")
            )

    def check_global_len(self, seq_len: int, world: int) -> None:
        """Raise a ValueError naming the fix if ``seq_len`` cannot be split over ``world`` ranks."""
        need = self.local_multiple() * world
        if seq_len <= 0 or seq_len % need:
            raise ValueError(
                f"layout='{self.name}' needs the sequence length to be divisible by {need} for {world} "
                f"ranks, got {seq_len}; pad it to a multiple of {need}"
                + (" or use layout='striped'" if self.name != "striped" else "")
            )


class Contiguous(Layout):
    """Rank r holds tokens ``[r*S/P, (r+1)*S/P)``. Simple, but causal work is unbalanced."""

    name = "contiguous"

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        s = seq_len // world
        return torch.arange(rank * s, (rank + 1) * s)

    def local_multiple(self) -> int:
        return 1

    def causal_tasks(self, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        if src == rank:
            return (BlockTask(_all(s), _all(s), True),)
        if src < rank:
            return (BlockTask(_all(s), _all(s), False),)
        return ()


class Zigzag(Layout):
    """2P equal chunks; rank r holds chunk r then chunk 2P-1-r. Every off-diagonal step is half a block."""

    name = "zigzag"

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        c = seq_len // (2 * world)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])

    def local_multiple(self) -> int:
        return 2

    def causal_tasks(self, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        h = s // 2
        if src == rank:  # local positions increase monotonically: plain causal on the whole block
            return (BlockTask(_all(s), _all(s), True),)
        if src < rank:  # chunk src precedes both query chunks; chunk 2P-1-src follows both
            return (BlockTask(_all(s), slice(0, h), False),)
        # src > rank: only the late query chunk sees the visitor, and it sees all of it
        return (BlockTask(slice(h, s), _all(s), False),)


class Striped(Layout):
    """Rank r holds tokens r, r+P, r+2P, ... (Striped Attention). Every step is about half a block."""

    name = "striped"

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        return torch.arange(rank, seq_len, world)

    def local_multiple(self) -> int:
        return 1

    def causal_tasks(self, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        # query i (pos i*P+rank) sees key j (pos j*P+src) iff j < i, or j == i and src <= rank
        if src <= rank:
            return (BlockTask(_all(s), _all(s), True),)
        if s == 1:
            return ()
        return (BlockTask(slice(1, s), slice(0, s - 1), True),)  # strictly lower: shift by one


class ShardView(Layout):
    """A schedule over several shards held in one tensor (a strategy's view of a base layout): it
    re-addresses the base layout's tasks, so a masked schedule is the base layout's one, moved
    (:meth:`masked_tasks`, which :func:`..masks.schedule` calls instead of deriving tiles)."""

    @abc.abstractmethod
    def masked_tasks(self, rule: Any, world: int, rank: int, src: int, s: int, tile: int | None = None,
                     one_task: Any = None) -> tuple[BlockTask, ...]:
        """The tasks under documents / windows ``rule`` (an :class:`~..masks.AttentionMask`). ``tile = s``: whole
        blocks, i.e. every pair of shards as a whole block of the base layout (with ``one_task``, as
        :func:`..masks.schedule` takes them); else tiles of ``tile`` rows (None: the base schedule's choice)."""


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (Contiguous(), Zigzag(), Striped())}


def get_layout(name: str | Layout) -> Layout:
    """The layout called ``name`` ("contiguous", "zigzag" or "striped"); a Layout passes through."""
    if isinstance(name, Layout):
        return name
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown layout {name!r}; use one of {sorted(LAYOUTS)}") from None
