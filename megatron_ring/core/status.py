"""In-band status of the K/V blocks on the ring: a rank whose input fails after the cross-rank check
makes EVERY rank raise, without a per-step host synchronisation.

Each K/V wire buffer carries one trailing element (in the wire's own dtype) holding its sender's status
code: 0 = fine, 1 = K/V the wire codec refuses (:class:`~megatron_ring.wire.codecs.WireFiniteError`: inf/NaN,
or beyond the fp16 range), 2 = any other input error this rank detected (after the cross-rank check, e.g.
a kernel that does not run on this rank's device). The code is written once by the block's owner and
forwarded unchanged with the block, so after the forward ring every rank has seen every rank's code.

A failing rank does NOT raise at once: it still takes part in every exchange of the forward ring (its
neighbours would otherwise wait for the group time-out), then raises its own error. The others read the
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
from typing import Any

import torch

from megatron_ring.core.buffers import POOL
from megatron_ring.wire.codecs import KVCodec, KVSpec
from megatron_ring.errors import WireFiniteError
from megatron_ring.errors import RingInputError

__all__ = ["RingInputError", "RingStatus", "status_buffers", "check_pending", "refuse_on_every_rank"]

OK, BAD_VALUES, BAD_INPUT = 0, 1, 2



def status_buffers(codec: KVCodec, spec: KVSpec, count: int) -> list[torch.Tensor]:
    """``count`` wire buffers with one status element after the codec's payload."""
    proto = codec.new_buffer(dataclasses.replace(spec, device=torch.device("meta")))
    return [POOL.take(proto.numel() + 1, proto.dtype, spec.device) for _ in range(count)]


def _reads_in_forward(codec: KVCodec, device: torch.device) -> bool:
    return device.type == "cpu" or bool(getattr(codec, "checks_values", False))


class RingStatus:
    """This rank's status and the codes received from every source rank during one forward ring."""

    def __init__(self, ring: Any, codec: KVCodec, device: torch.device) -> None:
        self.ring, self.codec = ring, codec
        self.local_error: BaseException | None = None
        self.codes = torch.zeros(ring.world, dtype=torch.float32, device=device)
        self.read_in_forward = _reads_in_forward(codec, device)

    def encode(self, k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor) -> int:
        """Encode the local block into ``raw`` (payload + status); remember an error instead of raising.
        Returns the status code written."""
        code = OK
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

    def settle(self, plan: Any) -> None:
        """After the forward ring: raise here, or leave the check for the backward ring (see module doc)."""
        if self.local_error is not None:
            raise self.local_error
        if self.read_in_forward:
            _raise_for(self.codes.tolist(), self.ring, self.codec)
            return
        host = torch.empty(self.codes.shape, dtype=self.codes.dtype, pin_memory=True)
        host.copy_(self.codes, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        plan.pending_status = getattr(plan, "pending_status", None) or []
        plan.pending_status.append((host, event, self.ring, self.codec))


def check_pending(plan: Any) -> None:
    """At the start of the backward ring: raise if the forward ring carried a failing rank's code."""
    pending = getattr(plan, "pending_status", None) or []
    plan.pending_status = None
    for host, event, ring, codec in pending:
        event.synchronize()  # waits for that small copy only (recorded at the end of the forward ring)
        _raise_for(host.tolist(), ring, codec)


def _raise_for(codes: list[float], ring: Any, codec: KVCodec) -> None:
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


def refuse_on_every_rank(ring: Any, codec: KVCodec | None, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
                         head_chunks: Any, check, *args: Any, steps: Any = None, mirror: Any = None,
                         pieces: int = 1) -> Any:
    """``check(*args)``; if it raises ValueError on this rank only (after the cross-rank check), take part in
    the forward ring with status :data:`BAD_INPUT` first, so the other ranks raise too instead of waiting.

    ``steps()`` gives the forward ring's length (fewer than P steps when a window shortens it); default P.
    ``mirror(exc)``: the other comm types' equivalent (``strategies.mirror``: their forward on zeros with a
    failing status); it raises."""
    try:
        return check(*args)
    except ValueError as exc:
        if ring.world > 1 and ring.group is not None and codec is not None and k.ndim == v.ndim == 4:
            if mirror is not None:
                mirror(exc)
            try:
                n = int(steps()) if steps is not None else ring.world
            except ValueError:  # the mask itself is invalid: every rank raises that before any exchange
                raise exc from None
            _refusal_ring(ring, codec, k, v, qkv_format, head_chunks, n, pieces)
        raise exc


def _refusal_ring(ring: Any, codec: KVCodec, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
                  head_chunks: Any, steps: int, pieces: int = 1) -> None:
    """The forward ring's exchanges, every piece marked :data:`BAD_INPUT`, received blocks forwarded
    unchanged (the same messages, in the same order, as :func:`~megatron_ring.core.engine.ring_forward`)."""
    from megatron_ring.core.heads import head_groups  # noqa: PLC0415 - the engine imports this module
    from megatron_ring.core.rotation import Rotation, divisor_at_most  # noqa: PLC0415

    if not (isinstance(head_chunks, int) and head_chunks >= 1):
        return  # every rank refuses head_chunks itself, before any exchange
    bhsd = (lambda s: (s[0], s[2], s[1], s[3])) if qkv_format == "bshd" else (lambda s: (s[1], s[2], s[0], s[3]))
    (b, h_kv, s, d), dv = bhsd(tuple(k.shape)), v.shape[-1]
    status = RingStatus(ring, codec, k.device)
    for hs in head_groups(h_kv, head_chunks):
        n = divisor_at_most(hs.stop - hs.start, pieces)
        hj = (hs.stop - hs.start) // n
        spec = KVSpec((b, hj, s, d), (b, hj, s, dv), k.dtype, k.device)
        rot = Rotation(ring, status_buffers(codec, spec, n + 1), "fwd_kv")
        for j in range(n):
            rot.piece(j).zero_()
            status.mark(rot.piece(j), BAD_INPUT)
        for step in range(steps - 1):
            for j in range(n):
                rot.arrived(j, step)
                rot.pass_on(j, step)
            rot.advance()
        rot.drain(steps)
        if status.read_in_forward:
            return  # the others raise at the end of this (first) forward ring
