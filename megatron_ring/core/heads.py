"""Head bookkeeping shared by the engine and the strategies."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_ring.errors import HeadSplitError

__all__ = ["head_groups", "HeadSplit", "head_split", "check_head_count"]


def head_groups(h_kv: int, groups: int) -> list[slice]:
    """Split K/V heads ``[0, h_kv)`` into ``groups`` near-equal slices (at most one slice per head)."""
    return list(_head_groups(h_kv, int(groups)))


@functools.lru_cache(maxsize=256)
def _head_groups(h_kv: int, groups: int) -> tuple[slice, ...]:
    n = max(1, min(groups, h_kv))
    bounds = [round(i * h_kv / n) for i in range(n + 1)]
    return tuple(slice(a, b) for a, b in zip(bounds, bounds[1:]))


def _kv_span(a: int, b: int, g: int) -> int:
    """How many K/V heads the query heads ``[a, b)`` use (``g`` query heads per K/V head)."""
    return (b - 1) // g - a // g + 1


@dataclass(frozen=True)
class HeadSplit:
    """How the all-to-all strategies split ``h`` query heads (``h_kv`` K/V heads) over ``world`` ranks.

    The rule (docs/strategies.md, "Heads"): rank j holds the CONTIGUOUS query heads ``q[j]``; the sizes are
    as even as they can be (``h % world`` ranks hold one head more), and among those compositions the
    one whose ranks need the fewest K/V heads (the largest count first, then the total) is taken, the
    larger slices first on ties. Rank j receives exactly the K/V heads its query heads use, ``kv[j]``
    (contiguous): a K/V head crosses the wire once per rank that needs it and never more. Where the rank's
    query heads are not an even GQA grouping of those K/V heads, it computes them in ``runs`` that are.
    """

    h: int
    h_kv: int
    world: int
    q: tuple[slice, ...]
    kv: tuple[slice, ...]

    @property
    def group(self) -> int:
        return self.h // self.h_kv

    @property
    def even(self) -> bool:
        """Every rank holds the same number of query heads and of K/V heads (equal all-to-all chunks)."""
        return len({_len(s) for s in self.q}) == 1 and len({_len(s) for s in self.kv}) == 1

    @property
    def shared(self) -> bool:
        """Some K/V head goes to more than one rank (its dK/dV are summed over ranks on the way back)."""
        return sum(_len(s) for s in self.kv) > self.h_kv

    def runs(self, rank: int) -> tuple[tuple[slice, slice], ...]:
        """The rank's heads as runs of even GQA groupings: ``(query heads, K/V heads)`` slices, local to
        ``q[rank]`` / ``kv[rank]``, each K/V head of a run serving the same number of the run's query heads
        (at most 3 runs: a partial group, whole groups, a partial group). One run when the rank's heads
        are already an even grouping."""
        g, qs, ks = self.group, self.q[rank], self.kv[rank]
        counts = [min(qs.stop, (k + 1) * g) - max(qs.start, k * g) for k in range(ks.start, ks.stop)]
        out, qi, i = [], 0, 0
        while i < len(counts):
            j = i
            while j < len(counts) and counts[j] == counts[i]:
                j += 1
            n = counts[i] * (j - i)
            out.append((slice(qi, qi + n), slice(i, j)))
            qi, i = qi + n, j
        return tuple(out)


def _len(s: slice) -> int:
    return s.stop - s.start


def check_head_count(h: int, world: int, what: str = "comm_type='a2a'") -> None:
    """:class:`~megatron_ring.errors.HeadSplitError` when ``h`` query heads cannot be split over ``world``
    ranks (``h < world``: a rank would hold no query head and idle through the whole attention)."""
    if h < world:
        raise HeadSplitError(
            f"{what} splits the {h} query heads over {world} ranks, but every rank needs at least one head "
            f"({h} < {world}); use comm_type='p2p', 'all_gather' or 'auto', or 'a2a+p2p' with an inner group "
            f"of at most {h} ranks")


@functools.lru_cache(maxsize=256)
def head_split(h: int, h_kv: int, world: int, what: str = "comm_type='a2a'") -> HeadSplit:
    """The :class:`HeadSplit` of ``h`` query heads and ``h_kv`` K/V heads over ``world`` ranks.

    Impossible only when ``h < world``: some rank would hold no query head (and idle through the whole
    attention); :class:`HeadSplitError` names the fix."""
    check_head_count(h, world, what)
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    g, lo, extra = h // h_kv, h // world, h % world
    # sizes: `extra` ranks hold lo + 1 heads; choose which (fewest K/V heads per rank, then in total).
    # best[(j, m)] = (min total, choice) for ranks j.. with m larger slices used so far, under a bound M.
    for bound in range(1, h_kv + 1):
        memo: dict[tuple[int, int], tuple[int, tuple[int, ...]] | None] = {}

        def best(j: int, m: int) -> tuple[int, tuple[int, ...]] | None:
            if j == world:
                return (0, ()) if m == extra else None
            if (j, m) not in memo:
                a = j * lo + m
                found = None
                for size in ((lo + 1, lo) if m < extra else (lo,)):  # larger first: preferred on ties
                    span = _kv_span(a, a + size, g)
                    if span > bound:
                        continue
                    rest = best(j + 1, m + (size > lo))
                    if rest is not None and (found is None or span + rest[0] < found[0]):
                        found = (span + rest[0], (size,) + rest[1])
                memo[(j, m)] = found
            return memo[(j, m)]

        got = best(0, 0)
        if got is not None:
            bounds = [0]
            for size in got[1]:
                bounds.append(bounds[-1] + size)
            q = tuple(slice(a, b) for a, b in zip(bounds, bounds[1:]))
            kv = tuple(slice(s.start // g, (s.stop - 1) // g + 1) for s in q)
            return HeadSplit(h, h_kv, world, q, kv)
    raise AssertionError("unreachable: a bound of h_kv always admits a split")  # pragma: no cover
