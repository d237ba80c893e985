"""Attention structure as data: documents (packed THD streams), causal, sliding windows.

:class:`AttentionMask` describes which (query, key) pairs of the GLOBAL token stream are visible:

* documents: ``cu_seqlens`` (global, ``[n_docs + 1]``); attention never crosses a document boundary, and
  tokens at or past ``cu_seqlens[-1]`` are padding (they see nothing and are seen by nothing);
* ``causal``: key j visible to query i only if ``j <= i``;
* ``window=(left, right)``: key j visible to query i only if ``i - left <= j <= i + right`` (``-1``:
  unbounded on that side).

:func:`schedule` turns it, for one (layout, P, rank, source rank, local length), into the list of
:class:`~megatron_ring.schedules.layouts.BlockTask` the engine computes at that ring step. Without documents and
window it IS the layout's own causal schedule (same tasks, same cost). Otherwise local rows are cut into
tiles; tile pairs are classified from their position/document ranges (no visible pair: skipped; every
pair visible: a full block) and only the ambiguous ones are checked element-wise. Each query tile then
gets one kernel call per run of visible key tiles of one kind (see :func:`_tasks`): full,
top-left causal, reversed causal (a window's lower edge, run unmasked on reversed rows), or with a
:class:`BlockMask` (an explicit mask built lazily at call time from the local position/document vectors
of the task, so a rank never holds an ``[S, S]`` mask and many short documents cost a handful of
block-diagonal masked calls, not one call per document). Schedules are cached per signature.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy
import torch

from megatron_ring.device import held_under_capture, to_device_together
from megatron_ring.schedules.bounded import BoundedLRU
from megatron_ring.schedules.layouts import BlockTask, Layout, ShardView, TaskKind, get_layout

__all__ = ["AttentionMask", "BlockMask", "schedule", "visible_pairs", "needed_steps", "doc_ids", "DocumentZigzag"]


@dataclass(frozen=True)
class AttentionMask:
    """The global visibility rule; hashable (it keys the schedule cache)."""

    causal: bool
    cu_seqlens: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None

    @property
    def plain(self) -> bool:
        """Only the layout's causal/full structure (the fast path: the layout's own tasks)."""
        return self.cu_seqlens is None and (self.window is None or self.window == (-1, -1))

    def doc_ids(self, pos: torch.Tensor) -> torch.Tensor:
        return doc_ids(pos, self.cu_seqlens)

    def allowed(self, qpos: torch.Tensor, qdoc: torch.Tensor, kpos: torch.Tensor,
                kdoc: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(qpos), len(kpos)]``: True where the pair is visible."""
        i, j = qpos[:, None], kpos[None, :]
        ok = (qdoc[:, None] == kdoc[None, :]) & (qdoc >= 0)[:, None]
        if self.causal:
            ok &= j <= i
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                ok &= j >= i - left
            if right >= 0:
                ok &= j <= i + right
        return ok

    def row_ranges(self, qpos: torch.Tensor, qdoc: torch.Tensor, kpos: torch.Tensor,
                   kdoc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What :meth:`allowed` gives, as each query row's visible key rows ``[lo, hi)`` (``lo == hi``: none), in
        O(rows log keys) without the ``[rows, keys]`` matrix. Exact where the key positions increase and their
        documents do not decrease (one run of a layout: documents, causality and the window each leave a row
        one range of keys); None otherwise."""
        kp, qp = kpos.numpy(), qpos.numpy()  # host vectors, in numpy (views): its sorted searches are the fast ones
        kd = numpy.where(kdoc.numpy() < 0, numpy.iinfo(numpy.int64).max, kdoc.numpy())  # padding: last along the rows
        if len(kp) > 1 and not (bool((kp[1:] > kp[:-1]).all()) and bool((kd[1:] >= kd[:-1]).all())):
            return None
        qd = qdoc.numpy()
        # each document's key rows [cut[d], cut[d + 1]), looked up per row (padding rows: any, emptied below)
        cut = numpy.searchsorted(kd, numpy.arange(int(qd.max(initial=0)) + 2))
        at = numpy.maximum(qd, 0)
        lo, hi = cut[at], cut[at + 1]
        if self.causal:
            hi = numpy.minimum(hi, numpy.searchsorted(kp, qp, side="right"))
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                lo = numpy.maximum(lo, numpy.searchsorted(kp, qp - left))
            if right >= 0:
                hi = numpy.minimum(hi, numpy.searchsorted(kp, qp + right, side="right"))
        empty = (hi <= lo) | (qd < 0)
        return torch.from_numpy(numpy.where(empty, 0, lo)), torch.from_numpy(numpy.where(empty, 0, hi))


def doc_ids(pos: torch.Tensor, cu_seqlens: Sequence[int] | None) -> torch.Tensor:
    """Document index of each global position (a host tensor); -1 for padding (at or past ``cu_seqlens[-1]``)."""
    if cu_seqlens is None:
        return torch.zeros_like(pos)
    p = pos.numpy()
    ids = numpy.searchsorted(numpy.asarray(cu_seqlens, dtype=numpy.int64), p, side="right") - 1
    return torch.from_numpy(numpy.where(p < cu_seqlens[-1], ids, -1))


@dataclass(frozen=True, eq=False)
class BlockMask:
    """An explicit mask for one task, built on demand from the rows' global positions and documents.

    The four index vectors are host tensors; :meth:`allowed` builds the mask on the device from their
    device copies, made at the first use per device and kept with the mask (which lives in the schedule
    cache), so a steady-state call copies nothing from the host."""

    rule: AttentionMask
    qpos: torch.Tensor
    qdoc: torch.Tensor
    kpos: torch.Tensor
    kdoc: torch.Tensor
    _on: dict = field(default_factory=dict, repr=False, compare=False)  # device -> the four vectors there

    def vectors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """``(qpos, qdoc, kpos, kdoc)`` on ``device`` (copied once per device, the four in one copy)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.qpos, self.qdoc, self.kpos, self.kdoc
        if device not in self._on:
            self._on[device] = tuple(to_device_together((self.qpos, self.qdoc, self.kpos, self.kdoc), device))
        held_under_capture(device, *self._on[device])  # a CUDA graph reading them: kept, whatever the cache evicts
        return self._on[device]

    def allowed(self, device: torch.device | str = "cpu", rows: slice = slice(None),
                keys: slice = slice(None)) -> torch.Tensor:
        """Bool ``[sq, sk]`` (True: visible), computed on ``device``; ``rows``/``keys``: only those query/key rows."""
        qpos, qdoc, kpos, kdoc = self.vectors(device)
        return self.rule.allowed(qpos[rows], qdoc[rows], kpos[keys], kdoc[keys])

    def row_ranges(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each query row's visible key rows ``[lo, hi)`` on the host (:meth:`AttentionMask.row_ranges`)."""
        return self.rule.row_ranges(self.qpos, self.qdoc, self.kpos, self.kdoc)

    def additive(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """``0`` where visible, ``-inf`` where hidden, in ``dtype``."""
        ok = self.allowed(device)
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


@dataclass(frozen=True)
class MaskedTask(BlockTask):
    """A :class:`BlockTask` whose pairs need an explicit :class:`BlockMask` (``causal`` is False).

    ``reversed``: the mask is exactly the upper triangle of a square block (key row >= query row: the
    lower edge ``j >= i - left`` of a window). Reversing the order of both query and key rows makes it a
    top-left causal block, so the engine runs it on the plain kernel, unmasked
    (:class:`~megatron_ring.kernels.block.ReversedKernel`); ``mask`` still describes it (for kernels that
    need the mask anyway, e.g. position-keyed dropout)."""

    mask: BlockMask | None = None
    reversed: bool = False

    @property
    def kind(self) -> TaskKind:
        return TaskKind.REVERSED if self.reversed else TaskKind.MASKED

    def explicit_mask(self) -> BlockMask | None:
        return self.mask


def _runs(pos: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``tile`` rows, never across a jump in the position stride (a run starts at
    its first row; the row after a jump opens the next run)."""
    n = len(pos)
    d = numpy.diff(pos.numpy())
    changes = (numpy.flatnonzero(d[1:] != d[:-1]) + 1).tolist()  # rows m whose stride d[m] is not d[m - 1]
    cuts = [0]
    a = 0
    while a < n - 1:  # the run [a, m] keeps the stride d[a]: m is the first change after a
        i = bisect.bisect_right(changes, a)
        m = changes[i] if i < len(changes) else n - 1
        if m >= n - 1:
            break
        cuts.append(m + 1)
        a = m + 1
    cuts.append(n)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        out += [(x, min(x + tile, b)) for x in range(a, b, tile)]
    return out


NONE, FULL, MIXED = 0, 1, 2  # a tile pair's kind by its ranges (:func:`_kinds`)
_KIND_NAMES = ("none", "full", "mixed")


def _none_full(rule: AttentionMask, qa, qb, dqa, dqb, ka, kb, dka, dkb, pad):
    """Whether no pair / every pair of a query run and a key run is visible, from the runs' first and last positions
    (``qa``, ``qb``, ``ka``, ``kb``) and documents (``dqa`` ...): positions and document ids increase along a run
    (padding has the largest id, ``pad``), so the end points bound every pair. Numbers for one pair of runs, or arrays
    that broadcast for many at once (the same expression)."""
    left, right = rule.window if rule.window is not None else (-1, -1)
    none = (dqa == pad) | (dka == pad) | (dkb < dqa) | (dka > dqb)
    full = (dqa == dqb) & (dqb == dka) & (dka == dkb)
    if rule.causal:
        none = none | (ka > qb)
        full = full & (kb <= qa)
    if left >= 0:
        none = none | (kb < qa - left)
        full = full & (ka >= qb - left)
    if right >= 0:
        none = none | (ka > qb + right)
        full = full & (kb <= qa + right)
    return none, full


def _run_ends(pos: torch.Tensor, doc: torch.Tensor, runs: Sequence[tuple[int, int]]) -> tuple[numpy.ndarray, ...]:
    """Each run's first and last position and first and last document (four arrays, one entry per run)."""
    r = numpy.asarray(runs, dtype=numpy.int64).reshape(-1, 2)
    p, d = pos.numpy(), doc.numpy()
    return p[r[:, 0]], p[r[:, 1] - 1], d[r[:, 0]], d[r[:, 1] - 1]


def _kinds(rule: AttentionMask, qends: tuple[numpy.ndarray, ...], kends: tuple[numpy.ndarray, ...],
           pad: int) -> numpy.ndarray:
    """:data:`NONE`, :data:`FULL` or :data:`MIXED` for every pair of a query run and a key run (``[query runs, key
    runs]``, :func:`_none_full`) from their :func:`_run_ends`, as array ops over all pairs at once (a block of
    Megatron's per-document zigzag has ~100 runs of rows: ~10k pairs)."""
    qa, qb, dqa, dqb = (x[:, None] for x in qends)
    ka, kb, dka, dkb = (x[None, :] for x in kends)
    none, full = _none_full(rule, qa, qb, dqa, dqb, ka, kb, dka, dkb, pad)
    return numpy.where(none, NONE, numpy.where(full, FULL, MIXED))


def _classify(rule: AttentionMask, qp: torch.Tensor, qd: torch.Tensor, kp: torch.Tensor, kd: torch.Tensor,
              pad: int) -> str:
    """'none', 'full' or 'mixed' for one pair of runs (:func:`_none_full` on numbers)."""
    qp, qd, kp, kd = qp.numpy(), qd.numpy(), kp.numpy(), kd.numpy()
    none, full = _none_full(rule, int(qp[0]), int(qp[-1]), int(qd[0]), int(qd[-1]), int(kp[0]), int(kp[-1]),
                            int(kd[0]), int(kd[-1]), pad)
    return "none" if none else "full" if full else "mixed"


def _documents(rule: AttentionMask, qpos: torch.Tensor, kpos: torch.Tensor):
    """``(qdoc, kdoc, qd, kd, pad)``: the rows' and keys' documents (-1: padding), the same with padding as ``pad``,
    the largest id (padding sorts last, as :func:`_classify` needs)."""
    qdoc, kdoc = rule.doc_ids(qpos), rule.doc_ids(kpos)
    pad = len(rule.cu_seqlens) if rule.cu_seqlens is not None else 1
    return qdoc, kdoc, torch.where(qdoc < 0, pad, qdoc), torch.where(kdoc < 0, pad, kdoc), pad


def _tasks(rule: AttentionMask, qpos: torch.Tensor, kpos: torch.Tensor, tile: int,
           shapes: bool = True) -> tuple[BlockTask, ...]:
    """Per query tile, its run of visible key tiles as kernel calls: adjacent full tiles make one full call;
    a tile whose pairs are exactly a causal triangle is a causal call, one that is exactly the reversed
    triangle (a window's lower edge) a reversed call (both unmasked); only the remaining mixed tiles
    (document edges, unaligned window edges) are masked calls, adjacent ones merged.

    ``shapes=False`` (whole blocks for a variable-length kernel): a tile pair mixed by its ranges is not
    looked at pair by pair (``[tile, tile]`` booleans: seconds at 8K rows) unless :func:`_band_shape` tells
    its shape from a vector; it is a masked call, which that kernel runs as fast as an unmasked one."""
    qdoc, kdoc, qd, kd, pad = _documents(rule, qpos, kpos)
    qtiles, ktiles = _runs(qpos, tile), _runs(kpos, tile)
    qends, kends = _run_ends(qpos, qd, qtiles), _run_ends(kpos, kd, ktiles)
    kinds = _kinds(rule, qends, kends, pad)
    bare = AttentionMask(rule.causal, None, rule.window)  # a tile pair within one document sees only this
    tasks: list[BlockTask] = []
    for i, (qa, qb) in enumerate(qtiles):
        row: list[tuple[int, int, str]] = []
        for j in numpy.flatnonzero(kinds[i]).tolist():  # the visible ones
            ka, kb = ktiles[j]
            kind = _KIND_NAMES[kinds[i, j]]
            if kind == "mixed":
                one_doc = qends[2][i] == qends[3][i] == kends[2][j] == kends[3][j] < pad
                kind = (_band_shape(bare if one_doc else rule, qpos[qa:qb], kpos[ka:kb])
                        or (_shape_of(rule, qpos[qa:qb], qdoc[qa:qb], kpos[ka:kb], kdoc[ka:kb])
                            if shapes else "mixed"))
            if kind == "none":
                continue
            if row and row[-1][1] == ka and row[-1][2] == kind in ("full", "mixed"):  # extend the run
                row[-1] = (row[-1][0], kb, "full" if row[-1][2] == kind == "full" else "mixed")
            else:
                row.append((ka, kb, kind))
        for ka, kb, kind in row:
            tasks.append(_task(rule, qpos, qdoc, kpos, kdoc, slice(qa, qb), slice(ka, kb), kind, shapes))
    return tuple(_merge_rows(tasks))


def _shape_of(rule: AttentionMask, qpos: torch.Tensor, qdoc: torch.Tensor, kpos: torch.Tensor,
              kdoc: torch.Tensor) -> str:
    """:func:`_shape` of these rows against these keys, from each row's visible key rows
    (:meth:`AttentionMask.row_ranges`, O(rows log keys)) where the keys allow it; else from the mask itself."""
    ranges = rule.row_ranges(qpos, qdoc, kpos, kdoc)
    if ranges is None:
        return _shape(rule.allowed(qpos, qdoc, kpos, kdoc))
    lo, hi = (x.numpy() for x in ranges)  # an empty row is (0, 0)
    n, m = len(lo), len(kpos)
    if not bool((hi > lo).any()):
        return "none"
    if bool((lo == 0).all()) and bool((hi == m).all()):
        return "full"
    if m == n:
        i = numpy.arange(n)
        last = i < n - 1
        for kind, want_lo, want_hi in (("causal", 0, i + 1), ("reversed", i, n), ("causal-1", 0, i),
                                       ("reversed-1", numpy.where(last, i + 1, 0), numpy.where(last, n, 0))):
            if bool((lo == want_lo).all()) and bool((hi == want_hi).all()):
                return kind
    return "mixed"


def _shape(ok: torch.Tensor) -> str:
    """What a tile pair's visibility is: 'none', 'full', 'causal' (top-left triangle), 'reversed'
    (upper triangle, key row >= query row), 'causal-1' / 'reversed-1' (the same without the diagonal:
    striped rows against a later rank), or 'mixed' (anything else: an explicit mask)."""
    if not bool(ok.any()):
        return "none"
    if bool(ok.all()):
        return "full"
    n = ok.shape[0]
    if ok.shape == (n, n):
        tri = torch.ones(n, n, dtype=torch.bool)
        for kind, want in (("causal", tri.tril()), ("reversed", tri.triu()), ("causal-1", tri.tril(-1)),
                           ("reversed-1", tri.triu(1))):
            if torch.equal(ok, want):
                return kind
    return "mixed"


def _band_shape(rule: AttentionMask, qp: torch.Tensor, kp: torch.Tensor) -> str | None:
    """:func:`_shape` without building the mask, for a window/causal rule without documents on a
    square tile pair whose rows share one stride: visibility then depends only on (key row - query
    row), a vector of ``2n - 1`` values. None when that does not apply."""
    n = len(qp)
    if rule.cu_seqlens is not None or len(kp) != n or n < 2:
        return None
    stride = int(qp[1] - qp[0])
    if int(kp[1] - kp[0]) != stride or int(qp[-1] - qp[0]) != stride * (n - 1) \
            or int(kp[-1] - kp[0]) != stride * (n - 1):
        return None
    dd = torch.arange(-(n - 1), n)
    diff = int(kp[0] - qp[0]) + dd * stride  # key position - query position on each diagonal
    vis = torch.ones(2 * n - 1, dtype=torch.bool)
    if rule.causal:
        vis &= diff <= 0
    left, right = rule.window if rule.window is not None else (-1, -1)
    if left >= 0:
        vis &= diff >= -left
    if right >= 0:
        vis &= diff <= right
    for kind, want in (("none", torch.zeros_like(vis)), ("full", torch.ones_like(vis)), ("causal", dd <= 0),
                       ("reversed", dd >= 0), ("causal-1", dd <= -1), ("reversed-1", dd >= 1)):
        if torch.equal(vis, want):
            return kind
    return "mixed"


def _task(rule, qpos, qdoc, kpos, kdoc, q: slice, kv: slice, kind: str, shapes: bool = True) -> BlockTask:
    if kind == "full":
        return BlockTask(q, kv, False)
    if kind == "mixed" and shapes:  # a run of mixed tiles: look again at the whole run
        kind = _shape_of(rule, qpos[q], qdoc[q], kpos[kv], kdoc[kv])
    if kind.endswith("-1"):  # without the diagonal: the triangle of one row and key fewer
        kind = kind[:-2]
        q, kv = ((slice(q.start + 1, q.stop), slice(kv.start, kv.stop - 1)) if kind == "causal"
                 else (slice(q.start, q.stop - 1), slice(kv.start + 1, kv.stop)))
    if kind == "causal":
        return BlockTask(q, kv, True)
    return MaskedTask(q, kv, False, BlockMask(rule, qpos[q], qdoc[q], kpos[kv], kdoc[kv]),
                      reversed=kind == "reversed")


def _merge_rows(tasks: list[BlockTask]) -> list[BlockTask]:
    """Merge vertically adjacent full tasks over the same key rows into one call."""
    out: list[BlockTask] = []
    for t in tasks:
        last = out[-1] if out else None
        if (last is not None and type(last) is BlockTask and type(t) is BlockTask and not last.causal
                and not t.causal and last.kv == t.kv and last.q.stop == t.q.start):
            out[-1] = BlockTask(slice(last.q.start, t.q.stop), t.kv, False)
        else:
            out.append(t)
    return out


def _held_bytes(tasks: tuple[BlockTask, ...]) -> int:
    """Host bytes a schedule's masks hold: the storages of their index vectors (each counted once)."""
    storages = {}
    for t in tasks:
        mask = t.explicit_mask()
        if mask is not None:
            for v in (mask.qpos, mask.qdoc, mask.kpos, mask.kdoc):
                st = v.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


#: schedules by signature: at most 4096, and masks holding at most 256 MiB of index vectors (a packed batch's new
#: documents make new schedules every micro-batch; at 8K rows per rank a schedule's masks hold about 256 KiB)
_CACHE = BoundedLRU(4096, 256 << 20, _held_bytes)


def default_tile(s: int) -> int:
    """Tile rows: about 16 tiles per local block (fine enough to skip window edges), at least 64."""
    return max(64, -(-s // 16))


def schedule(layout: Layout, rule: AttentionMask, world: int, rank: int, src: int, s: int,
             tile: int | None = None, one_task: Callable[[BlockMask], bool] | None = None) -> tuple[BlockTask, ...]:
    """The tasks rank ``rank`` computes against the K/V block of rank ``src`` (cached). ``tile``: rows per tile
    (None: chosen here); ``tile = s``, whole blocks for a variable-length kernel, skips the pair-by-pair shape
    checks (see :func:`_tasks`). ``one_task`` (with ``tile = s``): the kernel's test of a whole block's mask; where
    it passes, a block cut into many runs of rows is ONE masked task (:func:`_whole_block`), else the tasks of its
    runs."""
    if rule.plain:
        return layout.block_tasks(rule.causal, world, rank, src, s)
    one_task = one_task if tile == s else None
    key = (layout.name, rule, world, rank, src, s, tile, one_task)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if isinstance(layout, ShardView):  # a strategy's view of several shards (schedules/views.py): whole blocks too
        return _CACHE.put(key, layout.masked_tasks(rule, world, rank, src, s, tile, one_task))
    seq = s * world
    qpos, kpos = layout.positions(seq, world, rank), layout.positions(seq, world, src)
    tasks = None if one_task is None else _whole_block(rule, qpos, kpos, one_task)
    if tasks is None:
        tasks = _tasks(rule, qpos, kpos, tile or _band_tile(rule, qpos, kpos, s) or default_tile(s),
                       shapes=tile is None or tile < s)
    return _CACHE.put(key, tasks)


def _whole_block(rule: AttentionMask, qpos: torch.Tensor, kpos: torch.Tensor,
                 one_task: Callable[[BlockMask], bool]) -> tuple[BlockTask, ...] | None:
    """A whole block whose rows or keys fall into more than two runs of one position stride, as one task: none where
    no pair is visible, a full task where every pair is, else one masked task if ``one_task`` takes its mask. None
    otherwise, or where the positions do not increase along the rows (then the block is cut into its runs,
    :func:`_tasks`).

    Runs of rows are what tiles and the triangle shapes need; a variable-length kernel needs none, and cutting at
    every jump made a block of Megatron's per-document zigzag (two chunks per document) dozens of small calls, each
    with its merge (P = 8, 8K rows per rank, a web-like mix: up to 212 masked tasks per forward, and ~0.3 s
    to plan them on the host). A block of at most 2 x 2 runs (zigzag's two chunks) keeps them: its fully
    visible runs run on the dense kernel, faster than the variable-length flash kernel where that is cuDNN."""
    if len(qpos) < 2 or len(kpos) < 2 or (len(_runs(qpos, len(qpos))) <= 2 and len(_runs(kpos, len(kpos))) <= 2):
        return None
    if not (bool((qpos[1:] > qpos[:-1]).all()) and bool((kpos[1:] > kpos[:-1]).all())):
        return None
    qdoc, kdoc, qd, kd, pad = _documents(rule, qpos, kpos)
    rows, keys = slice(0, len(qpos)), slice(0, len(kpos))
    kind = _classify(rule, qpos, qd, kpos, kd, pad)
    if kind == "none":
        return ()
    if kind == "full":
        return (BlockTask(rows, keys, False),)
    mask = BlockMask(rule, qpos, qdoc, kpos, kdoc)
    return (MaskedTask(rows, keys, False, mask),) if one_task(mask) else None


def _band_tile(rule: AttentionMask, qpos: torch.Tensor, kpos: torch.Tensor, s: int) -> int | None:
    """For a window without documents: the largest tile (halving from the local length
    down to :func:`default_tile`) at which every visible tile pair is full, causal or reversed, so the
    band runs as a few big unmasked calls; None when no such tile exists (then the default tile)."""
    if rule.cu_seqlens is not None:
        return None
    tile, low = s, default_tile(s)
    one = torch.zeros(max(len(qpos), len(kpos)), dtype=torch.int64)  # no documents: one for every row
    while tile >= low:
        qt, kt = _runs(qpos, tile), _runs(kpos, tile)
        kinds = _kinds(rule, _run_ends(qpos, one, qt), _run_ends(kpos, one, kt), 1)
        if all(_band_shape(rule, qpos[qt[i][0]:qt[i][1]], kpos[kt[j][0]:kt[j][1]]) not in (None, "mixed")
               for i, j in zip(*(x.tolist() for x in numpy.nonzero(kinds == MIXED)))):
            return tile
        if tile % 2:
            break
        tile //= 2
    return None


def needed_steps(layout: Layout, rule: AttentionMask, world: int, s: int) -> int:
    """How many ring steps (K/V hops + 1) any rank needs: steps past the last one with a visible pair on ANY
    rank are dropped (a window spanning fewer ranks than P with a contiguous layout needs fewer hops).

    Only the window can shorten the ring here: documents are left out (they only remove pairs, so the
    count stays a safe upper bound) and the result is cached per (layout, causal, window, P, s). Whether a rank
    sees any key of another is asked of their positions alone (each row's visible keys, :meth:`AttentionMask.row_ranges`
    of the rule without documents), no schedule built: a layout made from a batch's documents
    (:class:`DocumentZigzag`) is new in every micro-batch."""
    if rule.window is None:
        return world
    key = (layout.name, rule.causal, rule.window, world, s)
    if key not in _STEPS:
        base = AttentionMask(rule.causal, None, rule.window)
        pos = [layout.positions(s * world, world, r).sort().values for r in range(world)]
        one_doc = torch.zeros(s, dtype=torch.int64)

        def sees_any(q: torch.Tensor, k: torch.Tensor) -> bool:
            lo, hi = base.row_ranges(q, one_doc, k, one_doc)
            return bool((hi > lo).any())

        last = max((t for t in range(1, world) if any(sees_any(pos[r], pos[(r - t) % world]) for r in range(world))),
                   default=0)
        if len(_STEPS) >= 4096:  # a layout of documents is new in every micro-batch: keep the memory bounded
            _STEPS.clear()
        _STEPS[key] = last + 1
    return _STEPS[key]


_STEPS: dict[tuple, int] = {}


def visible_pairs(layout: Layout, rule: AttentionMask, world: int, rank: int, s: int) -> int:
    """Visible (query, key) pairs rank ``rank`` computes over the whole ring (its causal work)."""
    seq = s * world
    qpos = layout.positions(seq, world, rank)
    qdoc = rule.doc_ids(qpos)
    total = 0
    for src in range(world):
        kpos = layout.positions(seq, world, src)
        for a in range(0, s, 1024):  # bounded memory
            total += int(rule.allowed(qpos[a:a + 1024], qdoc[a:a + 1024], kpos, rule.doc_ids(kpos)).sum())
    return total


class DocumentZigzag(Layout):
    """Zigzag within each document of a packed stream: every document (``cu_seqlens_padded``, lengths
    multiples of 2P) is cut into 2P equal chunks and rank r holds chunk r then chunk 2P-1-r of the first
    document, then of the second, ... This is the THD token order of Megatron-Core and TransformerEngine
    (``thd_get_partitioned_indices``), which Megatron's Mamba / GDN context parallelism assumes.

    One object per set of boundaries (its ``name`` carries them: schedules are cached by name). Tasks
    come from the positions (:func:`schedule`); pass the documents as ``cu_seqlens`` too, or
    attention crosses them (a plain causal mask is the global one over these positions)."""

    def __init__(self, cu_seqlens_padded) -> None:
        cu = [int(x) for x in (cu_seqlens_padded.tolist() if hasattr(cu_seqlens_padded, "tolist")
                               else cu_seqlens_padded)]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"DocumentZigzag needs cu_seqlens_padded starting at 0 and non-decreasing, got {cu}")
        self.cu = tuple(cu)
        self.name = f"zigzag/documents{self.cu}"

    @property
    def family(self) -> str:
        return "zigzag/documents"

    @property
    def without_documents(self) -> Layout:
        return get_layout("zigzag")  # the positions of DocumentZigzag((0, S))

    def _check(self, seq_len: int, world: int) -> None:
        if seq_len != self.cu[-1]:
            raise ValueError(f"layout {self.name} covers {self.cu[-1]} tokens, got a sequence of {seq_len}; "
                             "build it from this batch's cu_seqlens_padded")
        bad = [b - a for a, b in zip(self.cu, self.cu[1:]) if (b - a) % (2 * world)]
        if bad:
            raise ValueError(f"per-document zigzag over {world} ranks needs every (padded) document length to "
                             f"be a multiple of 2 x {world} = {2 * world}, got {bad}; pad each document to a "
                             f"multiple of {2 * world} (cu_seqlens_padded)")

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        self._check(seq_len, world)
        a = numpy.asarray(self.cu[:-1], dtype=numpy.int64)
        c = (numpy.asarray(self.cu[1:], dtype=numpy.int64) - a) // (2 * world)  # each document's chunk length
        # per document its chunks r and 2P-1-r, as runs of consecutive positions: each run's first position, repeated
        # over the run, plus the row's place in it
        first = numpy.stack((a + rank * c, a + (2 * world - 1 - rank) * c), 1).reshape(-1)
        count = numpy.repeat(c, 2)
        ends = numpy.cumsum(count)
        place = numpy.arange(int(ends[-1]) if len(ends) else 0) - numpy.repeat(ends - count, count)
        return torch.from_numpy(numpy.repeat(first, count) + place)

    def local_multiple(self) -> int:
        return 1

    def check_global_len(self, seq_len: int, world: int) -> None:
        self._check(seq_len, world)

    def causal_tasks(self, world: int, rank: int, src: int, s: int) -> tuple[BlockTask, ...]:
        return schedule(self, AttentionMask(True, (0, world * s)), world, rank, src, s)
