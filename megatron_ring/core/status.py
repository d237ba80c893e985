"""In-band status of the K/V blocks on the ring: a rank whose input fails after the cross-rank check
makes EVERY rank raise, without a per-step host synchronisation.

Each K/V wire buffer carries, FIRST, one element (in the wire's own dtype; the payload starts 16 bytes in, so it
keeps the buffer's alignment) holding its sender's status code. First, not last: a message shorter than the
receiver's buffer (ranks whose calls diverged onto another size gloo does not refuse) overwrites the element with
its sender's status instead of leaving an older call's behind. The codes: 1 = K/V the wire codec refuses (:class:`~megatron_ring.wire.codecs.WireFiniteError`: inf/NaN,
or beyond the fp16 range), 2 = any other input error this rank detected (after the cross-rank check, e.g.
a kernel that does not run on this rank's device), else fine: the call's tag as a value of the element's dtype
(:func:`tag_value`: a hash of the call's signature, dropout seed and call id, :func:`~.validation.call_tag`; 0
where the call is not checked across ranks). So every call also compares what each rank called: ranks whose sequences of
calls diverge (rank 0 calls with ``causal=True`` where rank 1 calls with ``causal=False``, both signatures seen
before, so the cross-rank all-gather is skipped) raise :class:`RingInputError` on every rank, naming the ranks
that called differently, with no collective per call. The tag takes one of about 16k values in a bf16 or fp16
element, 1e9 in fp32, 253 in the FP8 wire's bytes: two different calls go unnoticed with that chance only.
The code is written once by the block's owner and
forwarded unchanged with the block, so after a full forward ring (P steps) every rank has seen every rank's
code. The backward ring sends the same K/V again without these codes (the forward ring has judged these K/V);
its element says which call's backward it is instead (below). A ring that a window shortens to ``steps < P`` steps carries each block only ``steps - 1`` hops; it
then carries the codes (one small vector of P codes in the element's dtype, merged by maximum at every rank) the remaining
``P - steps`` hops (:meth:`RingStatus.spread`, channel ``fwd_status``), so every rank has seen every rank's
code there too: one small exchange per dropped step, launched only by windowed calls whose ring is shortened.

The backward ring compares which call's backward each rank runs (:mod:`.backward_check`); its checks on CUDA are
read with the next forward ring's codes (:meth:`PendingChecks.adopt`).

A failing rank does NOT raise at once: it still takes part in every exchange of the forward ring (its
neighbours would otherwise wait for the group time-out), then raises its own error. A rank whose input
is refused before its K/V could be encoded runs the same K/V stream with zeros and code 2
(:func:`~megatron_ring.core.engine.refuse_on_ring`): one protocol, whatever the failure. Every rank reads the codes ONCE per call, where reading is free or cannot be avoided:

* a device whose host reads are free (CPU, gloo): at the end of the forward ring (every wait there is a
  host wait anyway);
* a device with streams (CUDA): the codes are copied to host memory (pinned, ``non_blocking``) at the end
  of the forward ring, and read by the backward ring before its first exchange (the first place a missing
  rank would make the others wait), after the backward's set-up (its buffers, the K/V written into the wire)
  is launched: where a backward follows its forward at once (activation recomputation, a benchmark of one
  call) and the host must wait for the forward's end, that work is launched before the wait. The read first
  asks whether the copy's event is complete (:meth:`~megatron_ring.device.DeviceOps.event_done`, never
  blocks); only if the device has not reached the end of this call's forward ring yet does the host wait for
  it (one device-to-host synchronisation, on a copy of P codes). In training the backward of a layer starts after the forward of every
  later layer and the loss, so the copy is long complete: steady state makes no host sync;
* a call with no backward (``torch.no_grad``, inference) and a value-checking wire (fp8 with
  ``check_finite``, fp16): at the end of the forward ring, one synchronisation per call;
* a call with no backward on CUDA and a wire that checks no values: its host copy is left on the ring
  (:func:`defer`) and read with a later call's codes: the next call followed by a backward (at the start of its
  backward ring), or one that reads in its forward, or at the latest :data:`LATE_CHECKS` such calls later (in
  an inference loop), when its call is long complete on the device. So a refusal, or ranks that made different
  calls, raises on every rank, late: the error says that an earlier call's results were not valid. No
  synchronisation of its own.

Value checks of the wire (inf/NaN for FP8, the fp16 range) run ON THE DEVICE
(:meth:`~megatron_ring.wire.codecs.KVCodec.encode_flagged`): the verdict goes straight into the status
element, refused values travel as NaN, and no rank reads a value on the host during the ring. The rank
whose K/V was refused learns it at the same read as the others, and only then (on the failure path) runs
the codec's host check to name the first bad element in its error.

The others raise the same exception type, naming the failing global rank(s).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import torch

from megatron_ring.device import CAPTURED, DeviceOps, ops_for
from megatron_ring.core.buffers import POOL, SlotSet
from megatron_ring.schedules.on_device import cached_on
from megatron_ring.wire.codecs import KVCodec, KVSpec
from megatron_ring.errors import WireFiniteError
from megatron_ring.errors import RingInputError

__all__ = ["RingInputError", "RingStatus", "PendingChecks", "StatusRecorder", "status_buffers", "raise_for",
           "tag_value", "status_pattern", "status_elem", "payload_of", "values_of", "CAPTURED", "defer", "LATE_CHECKS",
           "spread_codes", "read_left", "assert_on_device", "settle_codes"]

OK, BAD_VALUES, BAD_INPUT = 0, 1, 2
#: checks a ring leaves for later calls (:func:`defer`) that may wait there; the oldest beyond are read at once
LATE_CHECKS = 64


@functools.lru_cache(maxsize=256)
def tag_value(tag: int, dtype: torch.dtype) -> float:
    """What a status element of ``dtype`` holds for a rank whose input is fine in a call tagged ``tag``: OK (0)
    where the call has no tag, else one of the finite values of ``dtype`` from 3 up (above the failure codes),
    chosen by the tag (floating point: by its bit pattern; the FP8 wire's byte elements: 3..255). Exact in the
    element, so it survives the copies and the maximum merge of :meth:`RingStatus.spread` unchanged."""
    if not tag:
        return OK
    lo, count, bits = values_of(dtype)
    if bits is None:
        return lo + tag % count
    return float(torch.tensor(lo + tag % count, dtype=bits).view(dtype))


@functools.lru_cache(maxsize=16)
def values_of(dtype: torch.dtype) -> tuple[int, int, torch.dtype | None]:
    """The values a tag takes in an element of ``dtype``: ``(lo, count, bits)``, the ``count`` consecutive integers
    from ``lo`` (``bits`` None), or bit patterns of ``dtype`` read as the integer dtype ``bits`` (3.0 up to the
    largest finite value)."""
    if not dtype.is_floating_point:
        return 3, torch.iinfo(dtype).max - 2, None
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    lo, hi = (int(torch.tensor(x, dtype=dtype).view(bits)) for x in (3.0, torch.finfo(dtype).max))
    return lo, hi - lo + 1, bits


def status_pattern(value: float, rank: int, world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[world + 1]``: ``value`` at ``rank`` and at the end, zeros elsewhere: what a call's codes (the first
    ``world``: this rank's own code) and its K/V's status elements (the last) start as. Made on the device once per
    (value, rank, world, dtype, device) (three launches, no host-to-device copy) and kept."""
    def make() -> torch.Tensor:
        t = torch.zeros(world + 1, dtype=dtype, device=device)
        t[rank].fill_(value)
        t[world].fill_(value)
        return t

    return cached_on(("status", value, rank, world, dtype), make, device)  # under capture: held for the process


def status_buffers(codec: KVCodec, spec: KVSpec, count: int) -> SlotSet:
    """``count`` wire buffers with the status element before the codec's payload (:func:`status_elem`,
    :func:`payload_of`), as one set from the pool (give it back with ``POOL.give_set``; keyed by ``(codec, spec)``,
    so views derived from a slot stay valid for as long as the set lives)."""
    numel, dtype = _wire_layout(codec, spec)
    return POOL.take_set((codec, spec), count, _lead(dtype) + numel, dtype, spec.device)


def _lead(dtype: torch.dtype) -> int:
    """Elements before a wire buffer's payload: 16 bytes (the status element and padding), so the payload keeps
    the buffer's alignment (the attention kernels read K/V decoded in place)."""
    return max(1, 16 // dtype.itemsize)


def status_elem(raw: torch.Tensor) -> torch.Tensor:
    """The status element of the wire buffer ``raw`` (its first element; a view)."""
    return raw[:1]


def payload_of(raw: torch.Tensor) -> torch.Tensor:
    """The codec's part of the wire buffer ``raw`` (after the status element and padding; a view)."""
    return raw[_lead(raw.dtype):]


@functools.lru_cache(maxsize=64)
def _wire_layout(codec: KVCodec, spec: KVSpec) -> tuple[int, torch.dtype]:
    """Elements and dtype of ``codec``'s wire buffer for ``spec`` (per signature: api.py reuses codecs)."""
    proto = codec.new_buffer(dataclasses.replace(spec, device=torch.device("meta")))
    return proto.numel(), proto.dtype


class StatusRecorder(Protocol):
    """Where a collective strategy's call records a refusal (``strategies.refusal.StrategyStatus``)."""

    error: BaseException | None

    def record(self, exc: BaseException) -> None:
        ...


class PendingChecks:
    """Status codes a forward ring left to check in the backward ring, before its first exchange (devices with
    streams, see the module doc): host copies with the event that completes each, and the check that judges
    them. One per plan, an explicit field of :class:`~megatron_ring.core.plan.RingPlan`; earlier backward rings'
    checks join it (:meth:`adopt`).

    ``backward_follows``: whether the call that runs the forward rings will run a backward (set by the
    autograd function; a call without one reads value-checking wires' codes at the forward's end)."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, Any, DeviceOps, Callable[[list[float]], None]]] = []
        self.backward_follows = True

    def add(self, host: torch.Tensor, event: Any, ops: DeviceOps, ring: Any, codec: KVCodec,
            explain: Callable[[], None] | None = None, fine: float = OK) -> None:
        self._items.append((host, event, ops, functools.partial(raise_for, ring=ring, codec=codec, explain=explain,
                                                                 fine=fine)))

    def adopt(self, ring: Any) -> None:
        """Take the checks earlier calls on ``ring`` left (:func:`defer`: backward rings', and on CUDA forward rings'
        without a backward), checked before this plan's own."""
        if ring.unchecked:
            self._items[:0] = ring.unchecked
            ring.unchecked = []

    def check(self) -> None:
        """Raise if a forward ring carried a failing rank's code, or an earlier backward ring another call's;
        the checks are consumed. Waits for a copy only if the device has not completed it yet (see the module
        doc)."""
        items, self._items = self._items, []
        for host, event, ops, judge in items:
            if not ops.event_done(event):
                ops.wait_event_host(event)  # the one possible sync: the forward ring's end not reached yet
            codes = host.tolist()
            ops.give_host(host)
            judge(codes)


class RingStatus:
    """This rank's status and the codes received from every source rank during one forward ring.

    ``refusal``: this rank's input was refused before the ring; every piece it sends carries
    :data:`BAD_INPUT` (its payload is whatever it encodes, zeros), and it raises ``refusal``.
    ``backward_follows``: False for a call without a backward (see the module doc). ``tag``: the call's tag
    (``RingPlan.tag``); ``fine`` is its value in the elements' ``dtype`` (what a rank whose input is fine
    sends, and every code reads when all is well)."""

    def __init__(self, ring: Any, codec: KVCodec, device: torch.device, dtype: torch.dtype,
                 refusal: BaseException | None = None, backward_follows: bool = True, tag: int = 0) -> None:
        self.ring, self.codec = ring, codec
        self.ops = ops_for(device)
        self.refusal = refusal
        self.local_error: BaseException | None = refusal
        self.fine = tag_value(tag, dtype)
        # the codes in the status elements' ``dtype`` (a code is copied from an element as it is; the codes and
        # the elements are written in ONE launch: :meth:`encode_pieces`); written there, not here
        self.codes = torch.empty(ring.world, dtype=dtype, device=device)
        self._mine = self.codes[ring.rank:ring.rank + 1]
        #: where the fine status comes from (None: zeros): the start of the codes and the elements' value
        self.pattern = (status_pattern(self.fine, ring.rank, ring.world, dtype, device) if self.fine != OK
                        else None)
        self.read_in_forward = self.ops.host_reads_free or (codec.checks_values and not backward_follows)
        self._checked: list[tuple[torch.Tensor, torch.Tensor]] = []  # pieces whose values the device checked

    def encode(self, k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor,
               write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
               ) -> tuple[int, torch.Tensor | None]:
        """Encode the local block into ``raw``'s payload (``write(k, v)`` where given: the same bytes, written
        through views made once); remember a host-side error instead of raising.
        Returns the status code and the codec's device verdict on the values (None: not checked)."""
        code, flag = (OK if self.refusal is None else BAD_INPUT), None
        try:
            flag = self.codec.encode_flagged(k, v, payload_of(raw)) if write is None else write(k, v)
        except WireFiniteError as exc:
            self.local_error, code = exc, BAD_VALUES
        except (ValueError, RuntimeError) as exc:
            self.local_error, code = exc, BAD_INPUT
        if flag is not None:
            self._checked.append((k, v))
        return code, flag

    def encode_pieces(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], raws: list[torch.Tensor],
                      writes: list | None = None, elems: list[torch.Tensor] | None = None,
                      zeroed: bool = False) -> None:
        """Encode the local block's pieces; every piece carries the worst code of them all. A value the
        codec refuses on the device makes the code :data:`BAD_VALUES` there, without a host read.
        ``writes``: per piece, a writer for :meth:`encode`; ``elems``: per piece, its status element
        (:func:`status_elem`, a view made once by the caller); ``zeroed``: the writers zeroed the elements and the
        codes (nothing more to write where every code is OK)."""
        writes = writes or [None] * len(raws)
        results = [self.encode(k, v, raw, w) for (k, v), raw, w in zip(blocks, raws, writes)]
        worst = max(code for code, _ in results)
        flags = [flag for _, flag in results if flag is not None]
        bad = None
        if flags and worst == OK:
            bad = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        elems = elems or [status_elem(raw) for raw in raws]
        if worst == OK and bad is None:
            if not zeroed:  # one launch on CUDA (one dtype, dense: torch's fast route)
                if self.pattern is None:
                    torch._foreach_zero_([self.codes, *elems])
                else:
                    torch._foreach_copy_([self.codes, *elems], self.sources(len(elems)))
            return
        self.codes.zero_()
        for elem in elems:
            self.mark(elem, worst, bad)

    def sources(self, n: int) -> list[torch.Tensor]:
        """What the codes and ``n`` status elements are copied from when this rank's input is fine (views of
        ``pattern``): the codes start with this rank's own at ``fine``, the others 0 until received."""
        world = self.ring.world
        return [self.pattern[:world]] + [self.pattern[world:]] * n

    def mark(self, elem: torch.Tensor, code: int, bad: torch.Tensor | None = None) -> None:
        """Write ``code`` (``fine`` for :data:`OK`; :data:`BAD_VALUES` where the device verdict ``bad`` is
        true) into the status element ``elem`` (a wire buffer's :func:`status_elem`) and as this rank's."""
        value = self.fine if code == OK else code
        elem.fill_(value)
        mine = self._mine
        mine.fill_(value)
        if bad is not None:
            elem.masked_fill_(bad, BAD_VALUES)
            mine.masked_fill_(bad, BAD_VALUES)

    def receipt(self, src: int, elem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What records the status element ``elem`` (:func:`status_elem`) of the block that came from group rank
        ``src``: ``(dst, elem)``, for ``dst.copy_(elem)`` (a device copy, no sync; on CUDA done by the step's
        first merge: :func:`~megatron_ring.core.merge.merge_into`)."""
        return self.codes[src:src + 1], elem

    def explain(self) -> None:
        """On the failure path only: this rank's own K/V were refused by the device check; raise the
        codec's host-side error naming the first bad element."""
        for k, v in self._checked:
            self.codec.check_values(k, v)

    def spread(self, steps: int) -> None:
        """After a forward ring of ``steps`` steps: carry the codes the ``P - steps`` hops the K/V blocks
        did not travel (a window dropped those steps), so that every rank has every rank's code.

        Every rank, the refusing one included, runs the same hops (same messages, same order)."""
        spread_codes(self.ring, self.codes, steps, "fwd_status")

    def settle(self, checks: PendingChecks) -> None:
        """After the forward ring: raise here, or leave the check for the backward ring (see module doc).

        A refusing rank raises here when the others read the codes here too; else it goes on through
        the call's other forward rings (a2a's runs of heads) and its caller raises once they are done."""
        if self.refusal is not None and not self.read_in_forward:
            return
        if self.local_error is not None:
            raise self.local_error
        settle_codes(self.codes, self.fine, self.ring, self.codec, self.ops, self.explain if self._checked else None,
                     self.read_in_forward, checks if checks.backward_follows else None)


def settle_codes(codes: torch.Tensor, fine: float, ring: Any, codec: KVCodec, ops: DeviceOps,
                 explain: Callable[[], None] | None, read_now: bool, checks: PendingChecks | None) -> None:
    """A call's gathered ``codes`` judged where reading costs nothing or cannot be avoided (the module doc; one
    protocol for the ring, :meth:`RingStatus.settle`, and the collective comm types, ``strategies/refusal.py``):

    * while a CUDA graph is captured, on the device at every replay (:func:`assert_on_device`);
    * ``read_now`` (reads are free, or no backward follows and the wire checks values): at once, the checks earlier
      calls left on ``ring`` first (this read waits for the device anyway);
    * else a host copy started now: handed to ``checks``, read by the call's backward with the checks earlier calls
      left on ``ring``; or, without a backward (``checks`` None), left on ``ring`` for a later call (:func:`defer`:
      a later call's, or :data:`LATE_CHECKS` calls later)."""
    if ops.capturing(codes.device):
        assert_on_device(codes, fine)
        return
    if read_now:
        read_left(ring)
        raise_for(codes.tolist(), ring, codec, explain, fine)
        return
    host, event = ops.to_host(codes)
    if checks is not None:
        checks.adopt(ring)
        checks.add(host, event, ops, ring, codec, explain, fine)
        return
    defer(ring, (host, event, ops, functools.partial(raise_for, ring=ring, codec=codec, fine=fine, late=True)))


def assert_on_device(codes: torch.Tensor, fine: float) -> None:
    """While a CUDA graph is captured: no host read, no event (what the host decided would not replay); every
    replay checks the call's ``codes`` on the device instead: a failing rank, or ranks that made different calls,
    stop it with a device-side assert."""
    torch._assert_async(torch.all(codes == fine),
                        "megatron_ring: a rank of the ring refused its input (its K/V cannot go on this wire, or a "
                        "rank-local input error), or the ranks made different calls; rerun eagerly to get the named "
                        "error")


def spread_codes(ring: Any, codes: torch.Tensor, steps: int, channel: str) -> None:
    """The hops of a ring that a window shortened to ``steps`` steps, for the per-rank ``codes`` (entry i: rank i's
    value, or 0 where not known yet): each hop sends this rank's whole vector to the next rank on ``channel`` and
    merges (maximum) the previous rank's into it. After the K/V stream rank r knows ranks r, r-1, .., r-steps+1;
    every hop adds one, so after ``P - steps`` hops every rank knows every rank's. The forward's codes
    (:meth:`RingStatus.spread`) and the backward's values (:meth:`~.backward_check.BackwardTag.spread`)."""
    for hop in range(steps, ring.world):
        got = torch.empty_like(codes)
        ring.exchange(codes.clone(), got, channel, hop).wait()
        torch.maximum(codes, got, out=codes)


def read_left(ring: Any, keep: int = 0) -> None:
    """Read the checks earlier calls left on ``ring`` (:func:`defer`), all but the newest ``keep``; raise if one
    fails. Waits for a copy only if the device has not completed it."""
    if len(ring.unchecked) <= keep:
        return
    cut = len(ring.unchecked) - keep
    checks = PendingChecks()
    checks._items, ring.unchecked = ring.unchecked[:cut], ring.unchecked[cut:]
    checks.check()


def defer(ring: Any, item: tuple) -> None:
    """Leave the check ``item`` (``(host copy, event, ops, judge)``, as :class:`PendingChecks` holds them) on
    ``ring`` for a later call (:meth:`PendingChecks.adopt`: the next forward ring followed by a backward, or read in
    the forward). At most :data:`LATE_CHECKS` wait there: the oldest beyond are read now, their calls long complete
    on the device (no wait in practice). Every rank in step leaves the same checks, so every rank reads them at the
    same call."""
    ring.unchecked.append(item)
    read_left(ring, keep=LATE_CHECKS)


def raise_for(codes: list[float], ring: Any, codec: KVCodec, explain: Callable[[], None] | None = None,
              fine: float = OK, late: bool = False) -> None:
    """Raise if any code is bad, or differs from ``fine`` (this rank's call's tag value): a rank that made
    another call. ``explain``: raises this rank's own detailed error when its own code is :data:`BAD_VALUES`
    (called only then). A code 0 where ``fine`` is not is a rank whose call was not checked across ranks
    (``check_consistency=False``): not compared. ``late``: the codes are an earlier call's (one without a
    backward, on CUDA: :func:`defer`), read at a later call: the message says so."""
    try:
        _raise_for(codes, ring, codec, explain, fine)
    except ValueError as exc:
        if not late:
            raise
        raise type(exc)(f"{exc} (Found in the status of an EARLIER call on this group, one without a backward, "
                        "read now: the results that call returned on every rank are not valid.)") from None


def _raise_for(codes: list[float], ring: Any, codec: KVCodec, explain: Callable[[], None] | None,
               fine: float) -> None:
    """:func:`raise_for`'s checks."""
    failed = {code: [ring.members[i] for i, x in enumerate(codes) if x == code] for code in (BAD_VALUES, BAD_INPUT)}
    me = ring.my_global
    if explain is not None and codes[ring.rank] == BAD_VALUES:
        explain()
    if failed[BAD_VALUES]:
        ranks = ", ".join(map(str, failed[BAD_VALUES]))
        raise WireFiniteError(
            f"{codec.name} wire: the K/V of ring global rank(s) {ranks} cannot be sent on this wire (inf/NaN, "
            f"or out of its range); that rank raised WireFiniteError naming the element, and every rank of "
            f"the ring stops here (this is global rank {me}). Find where the non-finite values come from, or "
            "choose another --cp-comm-dtype.")
    if failed[BAD_INPUT]:
        ranks = ", ".join(map(str, failed[BAD_INPUT]))
        raise RingInputError(
            f"ring_attention: ring global rank(s) {ranks} rejected their input after the cross-rank check (see "
            f"that rank's error); every rank of the ring stops here (this is global rank {me}).")
    if fine == OK:
        return
    other = [ring.members[i] for i, x in enumerate(codes) if x not in (fine, OK)]
    if other:
        calls: dict[float, list[int]] = {}
        for i, x in enumerate(codes):
            calls.setdefault(x, []).append(ring.members[i])
        groups = ", ".join("[" + ", ".join(map(str, ranks)) + "]" for ranks in calls.values())
        raise RingInputError(
            f"ring_attention: the ranks of the ring made different calls (other shapes, dtypes, options or "
            f"dropout seed): global rank(s) {', '.join(map(str, other))} called it otherwise than this rank (global "
            f"rank {me}); global ranks by the call they made: {groups}. Every rank of the group must make the same "
            "sequence of ring_attention calls with the same arguments: look for control flow that differs "
            "between ranks (a rank in eval mode, a layer or micro-batch skipped on one rank, an option read "
            "per rank). This call's result is not valid on any rank.")
