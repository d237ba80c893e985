"""In-band status of the K/V blocks on the ring: a rank whose input fails after the cross-rank check
makes EVERY rank raise, without a per-step host synchronisation.

Each K/V wire buffer carries one trailing element (in the wire's own dtype) holding its sender's status
code: 0 = fine, 1 = K/V the wire codec refuses (:class:`~megatron_ring.wire.codecs.WireFiniteError`: inf/NaN,
or beyond the fp16 range), 2 = any other input error this rank detected (after the cross-rank check, e.g.
a kernel that does not run on this rank's device). The code is written once by the block's owner and
forwarded unchanged with the block, so after the forward ring every rank has seen every rank's code.

A failing rank does NOT raise at once: it still takes part in every exchange of the forward ring (its
neighbours would otherwise wait for the group time-out), then raises its own error. A rank whose input
is refused before its K/V could be encoded runs the same K/V stream with zeros and code 2
(:func:`~megatron_ring.core.engine.refuse_on_ring`): one protocol, whatever the failure. The others read the
codes where reading is free or a synchronisation already happens:

* CPU (gloo): at the end of the forward ring (every wait there is a host wait anyway);
* CUDA with a value-checking codec (fp8 with ``check_finite``, fp16 wire): at the end of the forward ring
  (the codec's check already synchronises once per call);
* CUDA otherwise: the codes are copied to pinned host memory without blocking at the end of the forward
  ring, and checked at the start of the backward ring (the first place a missing rank would make the
  others wait), by then long complete.

The others raise the same exception type, naming the failing global rank(s).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import torch

from megatron_ring.core.buffers import POOL
from megatron_ring.wire.codecs import KVCodec, KVSpec
from megatron_ring.errors import WireFiniteError
from megatron_ring.errors import RingInputError

__all__ = ["RingInputError", "RingStatus", "PendingChecks", "StatusRecorder", "status_buffers", "raise_for"]

OK, BAD_VALUES, BAD_INPUT = 0, 1, 2



def status_buffers(codec: KVCodec, spec: KVSpec, count: int) -> list[torch.Tensor]:
    """``count`` wire buffers with one status element after the codec's payload."""
    numel, dtype = _wire_layout(codec, spec)
    return [POOL.take(numel + 1, dtype, spec.device) for _ in range(count)]


@functools.lru_cache(maxsize=64)
def _wire_layout(codec: KVCodec, spec: KVSpec) -> tuple[int, torch.dtype]:
    """Elements and dtype of ``codec``'s wire buffer for ``spec`` (per signature: api.py reuses codecs)."""
    proto = codec.new_buffer(dataclasses.replace(spec, device=torch.device("meta")))
    return proto.numel(), proto.dtype


def _reads_in_forward(codec: KVCodec, device: torch.device) -> bool:
    return device.type == "cpu" or bool(getattr(codec, "checks_values", False))


class StatusRecorder(Protocol):
    """Where a collective strategy's call records a refusal (``strategies.refusal.StrategyStatus``)."""

    error: BaseException | None

    def record(self, exc: BaseException) -> None:
        ...


class PendingChecks:
    """Status codes a forward ring left to check at the start of the backward ring (CUDA, see the module
    doc): pinned host copies with the event that completes each. One per plan, an explicit field of
    :class:`~megatron_ring.core.engine.RingPlan`."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, Any, Any, KVCodec]] = []

    def add(self, host: torch.Tensor, event: Any, ring: Any, codec: KVCodec) -> None:
        self._items.append((host, event, ring, codec))

    def check(self) -> None:
        """Raise if a forward ring carried a failing rank's code; the checks are consumed."""
        items, self._items = self._items, []
        for host, event, ring, codec in items:
            event.synchronize()  # waits for that small copy only (recorded at the end of the forward ring)
            raise_for(host.tolist(), ring, codec)


class RingStatus:
    """This rank's status and the codes received from every source rank during one forward ring.

    ``refusal``: this rank's input was refused before the ring; every piece it sends carries
    :data:`BAD_INPUT` (its payload is whatever it encodes, zeros), and it raises ``refusal``."""

    def __init__(self, ring: Any, codec: KVCodec, device: torch.device,
                 refusal: BaseException | None = None) -> None:
        self.ring, self.codec = ring, codec
        self.refusal = refusal
        self.local_error: BaseException | None = refusal
        self.codes = torch.zeros(ring.world, dtype=torch.float32, device=device)
        self.read_in_forward = _reads_in_forward(codec, device)

    def encode(self, k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor) -> int:
        """Encode the local block into ``raw`` (payload + status); remember an error instead of raising.
        Returns the status code written."""
        code = OK if self.refusal is None else BAD_INPUT
        try:
            self.codec.encode(k, v, raw[:-1])
        except WireFiniteError as exc:
            self.local_error, code = exc, BAD_VALUES
        except (ValueError, RuntimeError) as exc:
            self.local_error, code = exc, BAD_INPUT
        self.mark(raw, code)
        return code

    def encode_pieces(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], raws: list[torch.Tensor]) -> None:
        """Encode the local block's pieces; every piece carries the worst code of them all."""
        worst = max(self.encode(k, v, raw) for (k, v), raw in zip(blocks, raws))
        for raw in raws:
            self.mark(raw, worst)

    def mark(self, raw: torch.Tensor, code: int) -> None:
        raw[-1:].fill_(code)
        self.codes[self.ring.rank].fill_(code)

    def received(self, src: int, raw: torch.Tensor) -> None:
        """Record the status of the block that came from group rank ``src`` (a device copy, no sync)."""
        self.codes[src:src + 1].copy_(raw[-1:])

    def settle(self, checks: PendingChecks) -> None:
        """After the forward ring: raise here, or leave the check for the backward ring (see module doc).

        A refusing rank raises here when the others read the codes here too; else it goes on through
        the call's other forward rings (head chunks) and its caller raises once they are done."""
        if self.refusal is not None and not self.read_in_forward:
            return
        if self.local_error is not None:
            raise self.local_error
        if self.read_in_forward:
            raise_for(self.codes.tolist(), self.ring, self.codec)
            return
        host = torch.empty(self.codes.shape, dtype=self.codes.dtype, pin_memory=True)
        host.copy_(self.codes, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        checks.add(host, event, self.ring, self.codec)


def raise_for(codes: list[float], ring: Any, codec: KVCodec) -> None:
    bad = {int(c): [ring.members[i] for i, x in enumerate(codes) if int(x) == int(c)] for c in codes if c}
    if not bad:
        return
    me = ring.my_global
    if BAD_VALUES in bad:
        ranks = ", ".join(map(str, bad[BAD_VALUES]))
        raise WireFiniteError(
            f"{codec.name} wire: the K/V of ring global rank(s) {ranks} cannot be sent on this wire (inf/NaN, "
            f"or out of its range); that rank raised WireFiniteError naming the element, and every rank of "
            f"the ring stops here (this is global rank {me}). Find where the non-finite values come from, or "
            "choose another --cp-comm-dtype.")
    ranks = ", ".join(map(str, bad[BAD_INPUT]))
    raise RingInputError(
        f"ring_attention: ring global rank(s) {ranks} rejected their input after the cross-rank check (see "
        f"that rank's error); every rank of the ring stops here (this is global rank {me}).")
