"""Wire codecs: how one K/V block is packed into the single buffer that travels the ring.

A codec turns the visiting K and V blocks (each ``[b, h_kv, s, d]``, compute dtype) into ONE flat
1-D buffer and back. The engine allocates two buffers per ring (double buffering) with
:meth:`KVCodec.new_buffer`, calls :meth:`KVCodec.encode` once on the local block, forwards the
received bytes unchanged (no re-encoding, so a lossy codec never compounds error along the ring)
and calls :meth:`KVCodec.decode` on every block it receives.

Codecs are plain data for the engine: adding a wire format means adding a codec here, not a new loop.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch

__all__ = ["KVSpec", "KVCodec", "IdentityCodec", "make_codec"]


@dataclass(frozen=True)
class KVSpec:
    """Shape/dtype/device of the K and V blocks a codec packs (BHSD: ``[b, h_kv, s, d]``)."""

    k_shape: tuple[int, int, int, int]
    v_shape: tuple[int, int, int, int]
    dtype: torch.dtype
    device: torch.device

    @property
    def k_numel(self) -> int:
        return math.prod(self.k_shape)

    @property
    def v_numel(self) -> int:
        return math.prod(self.v_shape)


class KVCodec(abc.ABC):
    """Packs K and V into one flat buffer and back. Subclasses set ``name``."""

    name: str = "abstract"

    @abc.abstractmethod
    def new_buffer(self, spec: KVSpec) -> torch.Tensor:
        """An uninitialised 1-D wire buffer able to hold one encoded (K, V) pair."""

    @abc.abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """Write K, V (``[b, h_kv, s, d]``, any strides) into the wire buffer ``out``."""

    @abc.abstractmethod
    def decode(self, buf: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V in ``spec.dtype`` (``[b, h_kv, s, d]``; may be views into ``buf``)."""

    def wire_bytes(self, spec: KVSpec) -> int:
        """Bytes one encoded block occupies on the wire (payload plus any scales)."""
        buf = self.new_buffer(KVSpec(spec.k_shape, spec.v_shape, spec.dtype, torch.device("meta")))
        return buf.numel() * buf.element_size()


class IdentityCodec(KVCodec):
    """Sends K and V exactly as they are: ``[K.flatten(), V.flatten()]`` in the compute dtype."""

    name = "none"

    def new_buffer(self, spec: KVSpec) -> torch.Tensor:
        return torch.empty(spec.k_numel + spec.v_numel, dtype=spec.dtype, device=spec.device)

    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        nk = k.numel()
        out[:nk].view(k.shape).copy_(k)
        out[nk:].view(v.shape).copy_(v)

    def decode(self, buf: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        nk = spec.k_numel
        return buf[:nk].view(spec.k_shape), buf[nk:].view(spec.v_shape)


def make_codec(comm_dtype: torch.dtype | None, compute_dtype: torch.dtype) -> KVCodec:
    """The codec for a wire dtype. ``None`` (or the compute dtype itself) sends K/V unchanged."""
    if comm_dtype is None or comm_dtype == compute_dtype:
        return IdentityCodec()
    raise ValueError(
        f"comm_dtype={comm_dtype} is not supported; use None (send K/V as they are), "
        "torch.bfloat16 or torch.float8_e4m3fn"
    )
