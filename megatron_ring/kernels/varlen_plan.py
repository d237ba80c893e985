"""A masked task as calls of a variable-length flash kernel: the host-side segment plan.

A variable-length flash kernel (torch's ``aten._flash_attention_forward`` with ``cum_seq_q/k``; flash-attention
2's ``varlen`` functions) takes packed query rows and key rows cut into consecutive segments and attends each
query segment to its own key segment only, with one ``is_causal`` flag and one window for the whole call.
Its documented semantics, per segment of ``sq`` query and ``sk`` key rows (:func:`visible_in_segment`):
query ``a`` sees key ``b`` iff ``a + sk - sq - left <= b <= a + sk - sq + right`` (a window bound of -1 is
unbounded; causal is ``right = 0``): causal and windows are aligned to the bottom-right corner of each
segment. A query row that sees no key gets output 0 and lse ``+inf`` (our convention is ``-inf``).

:func:`plan_for` turns a :class:`~megatron_ring.schedules.masks.BlockMask` (one masked task: documents,
window edges, padding; read through its host vectors and ``allowed()``, the kernels do not import the
schedules) into such calls. Within a local block positions increase along the rows of every
layout and documents are contiguous runs, so each document present in both the task's query and key rows is
one segment; keys no query of the segment sees and query rows that see no key are trimmed off (into
segments of their own with no keys, or no queries), which makes the visible band of the segment end in its
bottom-right corner; then its rows' visible key ranges fix the window the call needs. Segments needing
different windows go to different calls (consecutive row ranges of the task); a task whose rows jump in
position stride and has no plan as a whole is cut into row pieces sharing its keys. The plan is verified against
the mask on the host, pair by pair; a task it cannot express exactly gets no plan (None: the caller falls
back to the math kernel). Plans are cached with the mask (which lives in the schedule cache) and their
index tensors are copied to a device once per (device, batch size).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import numpy
import torch

from megatron_ring.device import held_under_capture, to_device_together

__all__ = ["VarlenCall", "SegmentPlan", "plan_for", "build_plan", "visible_in_segment", "kernel_window"]


def visible_in_segment(sq: int, sk: int, causal: bool, left: int, right: int,
                       max_k: int | None = None) -> torch.Tensor:
    """Bool ``[sq, sk]``: the pairs a variable-length flash kernel computes in one segment (flash-attention's
    documented rule: query ``a`` attends keys ``[a + sk - sq - left, a + sk - sq + right]``, -1 unbounded,
    causal meaning ``right = 0``).

    ``max_k``: the call's ``max_seqlen_k``, which the kernel uses to rewrite the window first (flash-attention
    2's ``mha_varlen_fwd/bwd`` and ``set_params_fprop``, torch's copy included): a bound ``>= max_seqlen_k``
    becomes -1, then a -1 opposite a set bound becomes ``max_seqlen_k``. With more query rows than keys in a
    segment neither rewrite is harmless, hence :attr:`VarlenCall.kernel_max_k`."""
    if max_k is not None:
        left, right = kernel_window(causal, left, right, max_k)
    a = torch.arange(sq)[:, None]
    b = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    shift = sk - sq
    if causal:
        right = 0
    if left >= 0:
        ok &= b >= a + shift - left
    if right >= 0:
        ok &= b <= a + shift + right
    return ok


def kernel_window(causal: bool, left: int, right: int, max_k: int) -> tuple[int, int]:
    """The ``(left, right)`` window the kernel runs for a call given ``max_seqlen_k = max_k`` (its rewrites, see
    :func:`visible_in_segment`; causal: ``right = 0``)."""
    left, right = (-1 if w >= max_k else w for w in (left, right))
    if causal:
        right = 0
    if left < 0 <= right:
        left = max_k
    elif right < 0 <= left:
        right = max_k
    return left, right


@dataclass(frozen=True)
class VarlenCall:
    """One kernel call: query rows ``q`` and key rows ``kv`` of the task (slices), cut into segments by
    ``cum_q`` / ``cum_k`` (cumulative, relative to those rows, for a batch of one), the window
    ``(left, right)`` (-1: unbounded) and ``causal`` flag of the whole call."""

    q: slice
    kv: slice
    cum_q: tuple[int, ...]
    cum_k: tuple[int, ...]
    causal: bool
    window: tuple[int, int]

    @functools.cached_property  # read by every kernel call: once per plan
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cum_q, self.cum_q[1:]))

    @functools.cached_property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cum_k, self.cum_k[1:]))

    @functools.cached_property
    def kernel_max_k(self) -> int:
        """The ``max_seqlen_k`` the kernel is given: at least the longest key AND query segment and above both
        window bounds, so that the kernel's rewrites of the window (:func:`visible_in_segment`) change no pair:
        a bound is never dropped, and a bound it sets for a -1 reaches every key. The kernels read the real
        lengths from ``cum_seq_k``; this value only bounds them."""
        return max(self.max_k, self.max_q, self.window[0] + 1, self.window[1] + 1)

    def batched(self, b: int) -> tuple[list[int], list[int]]:
        """``cum_q``, ``cum_k`` for ``b`` batch rows packed one after another (each its own segments)."""
        nq, nk = self.q.stop - self.q.start, self.kv.stop - self.kv.start
        cq = [x + i * nq for i in range(b) for x in self.cum_q[:-1]] + [b * nq]
        ck = [x + i * nk for i in range(b) for x in self.cum_k[:-1]] + [b * nk]
        return cq, ck

    def visible(self) -> torch.Tensor:
        """Bool ``[rows, keys]`` of this call's rows: what the kernel computes (block-diagonal segments)."""
        ok = torch.zeros(self.q.stop - self.q.start, self.kv.stop - self.kv.start, dtype=torch.bool)
        for qa, qb, ka, kb in zip(self.cum_q, self.cum_q[1:], self.cum_k, self.cum_k[1:]):
            if qb > qa and kb > ka:
                ok[qa:qb, ka:kb] = visible_in_segment(qb - qa, kb - ka, self.causal, *self.window, self.kernel_max_k)
        return ok


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """The calls of one masked task. ``cum(device, b)``: per call, its int32 ``(cum_q, cum_k)`` on ``device``
    for batch size ``b``, copied there once (all of the plan's in one copy: views of one device tensor)."""

    calls: tuple[VarlenCall, ...]
    #: False: the calls' query rows, and their key rows, are consecutive and cover the task's once. True: the
    #: calls cover disjoint query rows but may share key rows (their dK/dV are added), and query rows no call
    #: covers see no key (out 0, lse -inf)
    shared_keys: bool = False
    _on: dict = field(default_factory=dict, repr=False)

    def cum(self, device: torch.device, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (torch.device(device), b)
        got = self._on.get(key)
        if got is None:
            cums = [torch.tensor(c, dtype=torch.int32) for call in self.calls for c in call.batched(b)]
            on = to_device_together(cums, device) if cums else []  # one copy for the whole plan
            got = self._on[key] = list(zip(on[0::2], on[1::2]))
        held_under_capture(device, *(t for pair in got for t in pair))  # a CUDA graph reading them: kept
        return got

    def visible(self, sq: int, sk: int) -> torch.Tensor:
        """Bool ``[sq, sk]``: the pairs the plan's calls compute."""
        ok = torch.zeros(sq, sk, dtype=torch.bool)
        for call in self.calls:
            ok[call.q, call.kv] |= call.visible()
        return ok


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BlockMask -> SegmentPlan or None


def plan_for(mask) -> SegmentPlan | None:
    """The segment plan of ``mask`` (a BlockMask; host work, once per mask); None if not expressible."""
    try:
        return _PLANS[mask]
    except KeyError:
        plan = _PLANS[mask] = build_plan(mask)
        return plan


@dataclass
class _Need:
    """What one segment needs of one window side: ``exact`` (that value) or any value >= ``least`` (or -1)."""

    exact: int | None
    least: int


def _row_spans(mask) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per query row, its visible key rows ``[lo, hi)`` (``BlockMask.row_ranges``, int64 host tensors); None where
    the mask's rows have no such ranges (then the plan is built from the ``[rows, keys]`` matrix)."""
    return mask.row_ranges()


def _host(t: torch.Tensor) -> numpy.ndarray:
    """A host index vector as a numpy array (a view of a CPU tensor's memory, no copy): the plan's row-wise work
    runs in numpy, whose calls on vectors of a few thousand rows cost a fraction of torch's (its per-call dispatch,
    and a binary search that does not use the order of the values searched)."""
    return t.numpy()


def _ordered(doc: numpy.ndarray) -> bool:
    """Whether the documents (padding, -1, left out) do not decrease along the rows."""
    d = doc[doc >= 0]
    return len(d) < 2 or bool((d[1:] >= d[:-1]).all())


def _doc_runs(doc: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Each document's run of rows: ``(ids, start, stop)`` (ids that do not decrease, :func:`_ordered`; -1: padding,
    left out), without a loop over rows."""
    at = numpy.flatnonzero(doc >= 0)
    if not len(at):
        return at, at, at
    ids = doc[at]
    new = numpy.flatnonzero(ids[1:] != ids[:-1]) + 1  # where a new document's run starts (besides the first)
    first, last = numpy.concatenate(((0,), new)), numpy.concatenate((new, (len(ids),))) - 1
    return ids[first], at[first], at[last] + 1


def _segments(qdoc, kdoc, spans):
    """The segments of a plan, one per document present in both the query and key rows, in order, for all
    documents at once (array ops over the rows, a loop over the documents only): each document's rows and keys
    trimmed to the rows that see a key and the keys some row sees, ``((qa, qb, ka, kb), right, left)`` with what its
    right and left window need (:class:`_Need`: the first row whose upper, or lower, bound is effective fixes it);
    those that see nothing left out. None when the documents are out of order along the rows or a segment is
    inexpressible (its keys are not its document's, or it needs a window below 0).

    ``spans``: each query row's visible keys ``[lo, hi)`` (``lo == hi``: none): the mask's row ranges
    (:func:`_row_spans`), or a function of each row's document's key run (``ka``, ``kb`` per row) giving them
    within it (:func:`_matrix_spans`)."""
    qdoc, kdoc = _host(qdoc), _host(kdoc)
    if not (_ordered(qdoc) and _ordered(kdoc)):
        return None  # documents out of order along the rows: not consecutive segments
    (qid, qa, qb), (kid, ka, kb) = _doc_runs(qdoc), _doc_runs(kdoc)
    _, iq, ik = numpy.intersect1d(qid, kid, assume_unique=True, return_indices=True)
    if not len(iq):
        return []
    qa, qb, ka, kb = qa[iq], qb[iq], ka[ik], kb[ik]  # the documents in both, in order
    n_rows = len(qdoc)
    rows = numpy.arange(n_rows)
    # a row's document (if it is in one's run): the segments' rows are consecutive, in order, so each segment's
    # values reduce over one stretch of rows (``reduceat`` from its first row; the first stretch from row 0)
    starts = numpy.concatenate(((0,), qa[1:]))
    seg = numpy.repeat(numpy.arange(len(qa)), numpy.concatenate((starts[1:], (n_rows,))) - starts)
    lo, hi = spans(ka[seg], kb[seg]) if callable(spans) else spans
    lo, hi = _host(lo), _host(hi)
    big = n_rows + len(kdoc) + 1
    live = (hi > lo) & (rows >= qa[seg]) & (rows < qb[seg])  # rows of a segment that see a key

    def per_seg(values: numpy.ndarray, where: numpy.ndarray, how, fill: int) -> numpy.ndarray:
        """Per segment, ``how`` (minimum, maximum) of ``values`` over its rows where ``where`` (else ``fill``)."""
        return how.reduceat(numpy.where(where, values, fill), starts)

    mn, mx = numpy.minimum, numpy.maximum
    ra, rb = per_seg(rows, live, mn, big), per_seg(rows + 1, live, mx, -1)
    ca, cb = per_seg(lo, live, mn, big), per_seg(hi, live, mx, -1)
    seen = rb >= 0
    if bool(((ca < ka) | (cb > kb))[seen].any()):
        return None  # keys of another document: not this segment's
    sq, sk = rb - ra, cb - ca
    shift = sk - sq
    # the first row whose upper bound is effective fixes the right window, the first whose lower one the left
    r_row = per_seg(rows, live & (hi < cb[seg]), mn, big)
    l_row = per_seg(rows, live & (lo > ca[seg]), mn, big)
    r_has, l_has = r_row < big, l_row < big
    r_at, l_at = r_row.clip(max=n_rows - 1), l_row.clip(max=n_rows - 1)
    right = hi[r_at] - 1 - ca - (r_row - ra) - shift
    left = (l_row - ra) + shift - (lo[l_at] - ca)
    if bool(((right < 0) & r_has & seen).any() or ((left < 0) & l_has & seen).any()):
        return None
    out = []
    for ok, r0, r1, c0, c1, rh, rv, lh, lv in zip(*(t.tolist() for t in (
            seen, ra, rb, ca, cb, r_has, right, l_has, left))):
        if ok:
            out.append(((r0, r1, c0, c1), _Need(rv, 0) if rh else _Need(None, r1 - r0 - 1),
                        _Need(lv, 0) if lh else _Need(None, c1 - c0 - 1)))
    return out


def _matrix_spans(ok: torch.Tensor):
    """:func:`_segments`' ``spans`` from the ``[rows, keys]`` matrix: each row's first and last visible key within
    its document's key run."""
    def spans(ka: numpy.ndarray, kb: numpy.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        cols = torch.arange(ok.shape[1])
        m = ok & (cols >= torch.from_numpy(ka)[:, None]) & (cols < torch.from_numpy(kb)[:, None])
        seen = m.any(1)
        lo = m.to(torch.uint8).argmax(1)  # the first maximum: the first visible key
        hi = ok.shape[1] - m.flip(1).to(torch.uint8).argmax(1)
        return torch.where(seen, lo, 0), torch.where(seen, hi, 0)
    return spans


def _spans_match(calls: list[VarlenCall], spans) -> bool:
    """Whether the calls compute exactly the rows' spans: per segment row, the kernel's band (its window
    rewrites included) against the mask's range; rows no call covers must see nothing."""
    lo_all, hi_all = _host(spans[0]), _host(spans[1])
    got_lo, got_hi = numpy.zeros_like(lo_all), numpy.zeros_like(hi_all)
    for c in calls:
        left, right = kernel_window(c.causal, *c.window, c.kernel_max_k)
        cq, ck = numpy.asarray(c.cum_q), numpy.asarray(c.cum_k) + c.kv.start
        nq = cq[1:] - cq[:-1]
        first, stop = numpy.repeat(ck[:-1], nq), numpy.repeat(ck[1:], nq)  # per row of the call: its segment's keys
        # and its diagonal, a + sk - sq from its segment's first key (a: the row within its segment)
        diag = numpy.repeat(ck[1:] - cq[1:], nq) + numpy.arange(cq[0], cq[-1])
        lo = first if left < 0 else numpy.maximum(diag - left, first)
        hi = stop if right < 0 else numpy.minimum(diag + right + 1, stop)
        vis = hi > lo
        rows = slice(c.q.start + int(cq[0]), c.q.start + int(cq[-1]))
        got_lo[rows] = numpy.where(vis, lo, 0)
        got_hi[rows] = numpy.where(vis, hi, 0)
    return bool(numpy.array_equal(got_lo, lo_all) and numpy.array_equal(got_hi, hi_all))


def _join(a: _Need, b: _Need) -> _Need | None:
    """One window value for two needs (None: none fits)."""
    if a.exact is not None and b.exact is not None:
        return a if a.exact == b.exact else None
    e = a if a.exact is not None else b if b.exact is not None else None
    least = max(a.least, b.least)
    if e is None:
        return _Need(None, least)
    return _Need(e.exact, 0) if e.exact >= least else None


def _call(segs: list[tuple[int, int, int, int]], q: slice, kv: slice, right: _Need, left: _Need) -> VarlenCall:
    """The call over rows ``q`` and keys ``kv`` with ``segs`` (task row indices): rows and keys between
    segments become segments without keys (their rows see nothing) or without queries."""
    cq, ck = [0], [0]
    at_q, at_k = q.start, kv.start

    def add(nq: int, nk: int) -> None:
        cq.append(cq[-1] + nq)
        ck.append(ck[-1] + nk)

    for qa, qb, ka, kb in segs:
        if qa > at_q:
            add(qa - at_q, 0)
        if ka > at_k:
            add(0, ka - at_k)
        add(qb - qa, kb - ka)
        at_q, at_k = qb, kb
    if q.stop > at_q:
        add(q.stop - at_q, 0)
    if kv.stop > at_k:
        add(0, kv.stop - at_k)
    r = -1 if right.exact is None else right.exact
    lft = -1 if left.exact is None else left.exact
    if r == lft == -1 and max(b - a for a, b in zip(cq, cq[1:])) == 1:
        # flash's varlen forward takes segments of at most one query row, GQA and no window as one query per
        # segment (it folds the query heads into rows), which segments without queries break: an unbounded
        # right window spelled as the longest segment's length (the same pairs) keeps it off that path
        r = max(b - a for a, b in zip(ck, ck[1:]))
    causal = r == 0 and lft == -1
    return VarlenCall(q, kv, tuple(cq), tuple(ck), causal, (lft, r))


def _rows_plan(mask) -> SegmentPlan | None:
    """The plan from the rows' ranges (:func:`_row_spans`; no ``[rows, keys]`` matrix), checked against them; None
    where the keys' positions do not increase or that plan does not match."""
    spans = _row_spans(mask)
    if spans is None:
        return None
    segs = _segments(mask.qdoc, mask.kdoc, spans)
    calls = None if segs is None else _group_calls(segs, len(mask.qdoc), len(mask.kdoc))
    if calls is None or not _spans_match(calls, spans):
        return None
    return SegmentPlan(tuple(calls), shared_keys=not calls)  # no call: rows see nothing, out 0


def one_task(mask) -> bool:
    """Whether a whole block's mask runs as ONE task on the variable-length kernel: it has a plan from its rows'
    ranges, found without the ``[rows, keys]`` matrix (kept for the kernel, as :func:`plan_for` keeps plans).
    The engine hands it to the schedule (``schedules.masks.schedule(..., one_task=)``)."""
    plan = _rows_plan(mask)
    if plan is not None:
        _PLANS[mask] = plan
    return plan is not None


def build_plan(mask) -> SegmentPlan | None:
    """The segment plan of a BlockMask (see the module doc), verified pair by pair; None if the mask has no
    exact plan (then the math kernel runs the task).

    A task whose query rows jump in position stride (zigzag's two chunks in one task) and that has no plan
    as a whole gets one plan per run of query rows of one stride: those calls share key rows (their dK/dV
    are added, :attr:`SegmentPlan.shared_keys`)."""
    plan = _rows_plan(mask)
    if plan is not None:
        return plan
    qdoc, kdoc = mask.qdoc, mask.kdoc
    ok = mask.allowed()
    whole = _build(ok, qdoc, kdoc)
    if whole:
        return SegmentPlan(tuple(whole))
    calls = []
    for a, b in _pairs(_cuts(ok, mask.qpos.tolist(), mask.kpos.tolist())):
        part = _build(ok[a:b], qdoc[a:b], kdoc)
        pieces = [(a, b, part)] if part is not None else _greedy(ok, qdoc, kdoc, a, b)
        if pieces is None:
            return None
        for a_, _, part_ in pieces:
            calls += [VarlenCall(slice(c.q.start + a_, c.q.stop + a_), c.kv, c.cum_q, c.cum_k, c.causal, c.window)
                      for c in part_]
    return SegmentPlan(tuple(calls), shared_keys=True) if len(calls) <= MAX_CALLS else None


#: more calls than this for one task: the math kernel runs it instead (a fragmented plan is no faster)
MAX_CALLS = 8


def _pairs(cuts: list[int]) -> list[tuple[int, int]]:
    return list(zip(cuts, cuts[1:]))


def _greedy(ok: torch.Tensor, qdoc: torch.Tensor, kdoc: torch.Tensor, a: int, b: int):
    """Query rows ``[a, b)`` as consecutive pieces, each as long as a plan of its own allows (a key stride
    that differs from the rows' makes a window's bounds step unevenly); None past :data:`MAX_CALLS` pieces."""
    pieces = []
    while a < b:
        best = None
        for end in range(a + 1, b + 1):
            part = _build(ok[a:end], qdoc[a:end], kdoc)
            if part is None and best is not None:
                break
            if part is not None:
                best = (a, end, part)
        if best is None or len(pieces) >= MAX_CALLS:
            return None
        pieces.append(best)
        a = best[1]
    return pieces


def _stride_runs(pos: list[int]) -> list[int]:
    """Run number of each row: a run is a stretch of rows of one position stride (a jump opens a new one)."""
    run, out = 0, [0] * len(pos)
    for i in range(2, len(pos)):
        if pos[i] - pos[i - 1] != pos[i - 1] - pos[i - 2] and (i < 3 or out[i - 1] == out[i - 2]):
            run += 1
        out[i] = run
    return out


def _cuts(ok: torch.Tensor, qpos: list[int], kpos: list[int]) -> list[int]:
    """Where to cut the query rows of a task that has no plan as a whole: at a jump in their position stride
    and where the runs of key rows a row sees change (a row that sees nothing goes with the row before)."""
    qrun, krun = _stride_runs(qpos), _stride_runs(kpos)
    seen = [tuple(sorted({krun[j] for j, x in enumerate(row) if x})) for row in ok.tolist()]
    first = next((x for x in seen if x), ())
    sig, last = [], first  # leading rows that see nothing go with the first row that sees a key
    for i, x in enumerate(seen):
        last = x or last
        sig.append((qrun[i], last))
    return [0] + [i for i in range(1, len(sig)) if sig[i] != sig[i - 1]] + [len(sig)]


def _build(ok: torch.Tensor, qdoc: torch.Tensor, kdoc: torch.Tensor) -> list[VarlenCall] | None:
    """The calls of one plan for the pairs ``ok`` (query and key rows consecutive), verified; or None."""
    sq, sk = ok.shape
    segs = _segments(qdoc, kdoc, _matrix_spans(ok))
    calls = None if segs is None else _group_calls(segs, sq, sk)
    if not calls:
        return calls
    seen = torch.zeros(sq, sk, dtype=torch.bool)
    for call in calls:
        seen[call.q, call.kv] = call.visible()
    return calls if torch.equal(seen, ok) else None


def _group_calls(segs: list, sq: int, sk: int) -> list[VarlenCall]:
    """The calls of one plan over ``sq`` query and ``sk`` key rows from its documents' segments, in order
    (:func:`_segments`): consecutive segments whose windows agree share a call."""
    groups: list[tuple[list, _Need, _Need]] = []
    for rows, right, left in segs:
        if groups:
            members, r0, l0 = groups[-1]
            r1, l1 = _join(r0, right), _join(l0, left)
            if r1 is not None and l1 is not None:
                groups[-1] = (members + [rows], r1, l1)
                continue
        groups.append(([rows], right, left))
    if not groups:
        return []  # nothing visible: no call (rows no call covers see no key)
    calls = []
    for i, (members, right, left) in enumerate(groups):
        q0 = 0 if i == 0 else members[0][0]
        k0 = 0 if i == 0 else members[0][2]
        q1 = sq if i == len(groups) - 1 else groups[i + 1][0][0][0]
        k1 = sk if i == len(groups) - 1 else groups[i + 1][0][0][2]
        calls.append(_call(members, slice(q0, q1), slice(k0, k1), right, left))
    return calls
