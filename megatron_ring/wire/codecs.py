"""Wire codecs: how one K/V block is packed into the single buffer that travels the ring.

A codec turns K and V (each ``[b, h_kv, s, d]``, compute dtype) into ONE flat 1-D buffer and back. The
engine streams a block in ``n`` pieces of K/V heads (``kv_pieces``) through ``n + 1`` slots
(``core/rotation.py``); each slot is a wire buffer of one piece, shaped like :meth:`KVCodec.new_buffer`
(plus one status element, ``core/status.py``) and taken from the engine's buffer pool
(``core/buffers.py``). The engine calls :meth:`KVCodec.encode` once per piece of the local block,
forwards the received bytes unchanged (no re-encoding, so a lossy codec never compounds error along the
ring) and calls :meth:`KVCodec.decode` on every piece it receives. :meth:`KVCodec.wire_bytes` is what one
encoded block costs on the wire (the benchmark and the cost model read it).

Codecs are plain data for the engine: adding a wire format means adding a codec here, not a new loop.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable

import torch
from megatron_ring.errors import WireFiniteError
from megatron_ring.wire.fp8_triton import fp8_scales, pow2_scales

__all__ = [
    "KVSpec",
    "KVCodec",
    "IdentityCodec",
    "CastCodec",
    "FP8Codec",
    "WireFiniteError",
    "make_codec",
    "wire_dtype",
    "COMM_DTYPE_ALIASES",
]


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
    #: whether the codec checks values (:meth:`encode` raises; :meth:`encode_flagged` returns a device verdict)
    checks_values: bool = False
    #: where Triton is (set by the call that makes the codec, call.py): ``rule(*tensors)`` says whether a fused
    #: kernel may be launched directly (else its registered op runs); None: torch's ops only
    launch_rule: Callable[..., bool] | None = None

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

    def encode_flagged(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """:meth:`encode` without reading any value on the host (no device synchronisation): a codec that
        checks values returns its verdict as a 0-dim bool tensor on the device (True: the wire refuses
        these values; they are encoded so that they decode as inf/NaN, never as a finite wrong value);
        a codec that checks nothing returns None. The ring puts the verdict in its status element
        (``core/status.py``)."""
        self.encode(k, v, out)
        return None

    def check_values(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise :class:`WireFiniteError` naming the first element this wire refuses (a host read; the
        failure path of :meth:`encode_flagged`, and :meth:`encode` itself)."""



def _first_bad(mask_ok: torch.Tensor) -> tuple[int, ...]:
    """Index of the first ``False`` in ``mask_ok`` (for error messages)."""
    return tuple(int(i) for i in (~mask_ok).nonzero()[0].tolist())


class _FlatCodec(KVCodec):
    """``[K.flatten(), V.flatten()]`` in one buffer of a float dtype (:meth:`_wire`)."""

    def _wire(self, spec: KVSpec) -> torch.dtype:
        raise NotImplementedError

    def _check(self, x: torch.Tensor, what: str) -> None:
        """Hook: refuse values the wire cannot carry."""

    def new_buffer(self, spec: KVSpec) -> torch.Tensor:
        return torch.empty(spec.k_numel + spec.v_numel, dtype=self._wire(spec), device=spec.device)

    def wire_bytes(self, spec: KVSpec) -> int:
        return (spec.k_numel + spec.v_numel) * self._wire(spec).itemsize

    def check_values(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, "K")
        self._check(v, "V")

    def _refused(self, x: torch.Tensor) -> torch.Tensor | None:
        """Hook: the device verdict (0-dim bool) on the values of ``x`` (None: nothing checked)."""
        return None

    def encode_flagged(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        flags = [f for f in (self._refused(k), self._refused(v)) if f is not None]
        self._copy_in(k, v, out)
        return None if not flags else flags[0] if len(flags) == 1 else flags[0] | flags[1]

    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        self.check_values(k, v)
        self._copy_in(k, v, out)

    def _copy_in(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        nk = k.numel()
        out[:nk].view(k.shape).copy_(k)
        out[nk:].view(v.shape).copy_(v)

    def decode(self, buf: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        nk = spec.k_numel  # .to() of the same dtype returns the view itself: no copy for IdentityCodec
        return buf[:nk].view(spec.k_shape).to(spec.dtype), buf[nk:].view(spec.v_shape).to(spec.dtype)


class IdentityCodec(_FlatCodec):
    """Sends K and V exactly as they are: ``[K.flatten(), V.flatten()]`` in the compute dtype."""

    name = "none"

    def _wire(self, spec: KVSpec) -> torch.dtype:
        return spec.dtype


class CastCodec(_FlatCodec):
    """Sends K and V cast to a 16/32-bit float ``wire_dtype``: ``[K.flatten(), V.flatten()]``.

    Decoding casts back to the compute dtype (round to nearest even). BF16 keeps the fp32 exponent
    range: relative error <= 2^-8 per element (only fp32 |x| > 3.39e38 would round to inf; not
    checked). FP16 keeps 11 significant bits but overflows above 65504, so an FP16 wire fed from
    fp32/bf16 checks magnitudes and raises :class:`WireFiniteError` instead of silently sending
    inf. inf/NaN inputs are carried as they are, exactly like :class:`IdentityCodec`.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        if not wire_dtype.is_floating_point or wire_dtype.itemsize < 2:
            raise ValueError(f"CastCodec needs a 16/32-bit float wire dtype, got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.checks_values = wire_dtype == torch.float16
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
            wire_dtype, str(wire_dtype)
        )

    def _wire(self, spec: KVSpec) -> torch.dtype:
        return self.wire_dtype

    def _check(self, x: torch.Tensor, what: str) -> None:
        """Raise if ``x`` would overflow an FP16 wire (only checked when the wire is FP16)."""
        if self.wire_dtype != torch.float16 or x.dtype == torch.float16 or x.numel() == 0:
            return
        ok = self._fits(x)
        if not bool(ok.all()):
            raise WireFiniteError(
                f"fp16 wire: {what} has finite |x| > {torch.finfo(torch.float16).max:g} (fp16 max) at "
                f"[b, h, s, d]={_first_bad(ok)}; use comm_dtype=torch.bfloat16 or fp8 (scaled)"
            )


    def _refused(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.wire_dtype != torch.float16 or x.dtype == torch.float16 or x.numel() == 0:
            return None
        return ~self._fits(x).all()  # stays on the device; the overflowing values travel as inf

    @staticmethod
    def _fits(x: torch.Tensor) -> torch.Tensor:
        """Per element: fits an fp16 wire (genuine inf/NaN are carried as they are)."""
        return (x.abs() <= torch.finfo(torch.float16).max) | ~torch.isfinite(x)




#: the FP8 wire buffer's size is a multiple of this many bytes (:class:`FP8Codec`: buffers laid back to back stay
#: aligned for the fp32 view of their scales and for 16-byte vector access)
WIRE_ALIGN = 16


class FP8Codec(KVCodec):
    """Scaled FP8 wire: K/V quantized to ``fp8_dtype`` with one fp32 power-of-two scale per group.

    A group is ``group_tokens`` consecutive tokens of one (batch, kv-head) of K (or V); ``None``
    means one scale per (batch, kv-head) for the whole block. For each group
    ``scale = 2^ceil(log2(amax / fp8_max))`` (so ``amax / scale`` lies in ``(fp8_max/2, fp8_max]``;
    ``amax == 0`` gives scale 1), clamped to ``[2^-120, 2^120]``.
    ``payload = fp8(x / scale)`` and decode is ``payload * scale`` -- with a power-of-two scale both
    multiplications are exact, so the only error is the FP8 rounding of ``x / scale``:
    ``|x_hat - x| <= 2^-m |x| + scale * 2^-(subnormal_bits)`` (m = 4 for e4m3, 3 for e5m2).

    Wire buffer: ONE 1-D ``uint8`` tensor (gloo collectives reject fp8; point-to-point does not care)::

        [ K scales fp32 (b*h_k*gk) | V scales fp32 (b*h_v*gv) | K fp8 (b*h_k*s*d_k) | V fp8 (b*h_v*s*d_v) | tail ]

    Scales come first so their fp32 view is 4-byte aligned; ``g = ceil(s / group_tokens)``. The unused ``tail``
    (zeroed by the encoder, so an input gives the same bytes; never read) rounds the buffer up to a multiple of
    :data:`WIRE_ALIGN` bytes, so that buffers the collective strategies lay back to back (all_gather's chunks, a2a's
    splits) start aligned too: with ``b*h*s*(d_k+d_v)`` not a multiple of 4 the next rank's scales could not be
    viewed as fp32.

    Non-finite input: with ``check_finite=True`` (default) :meth:`encode` raises
    :class:`WireFiniteError` naming the tensor and the first bad (b, h, group). With ``False`` (no
    host sync) the scale of an affected group is set to NaN, so that whole group decodes to NaN --
    it never becomes a saturated finite value.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        group_tokens: int | None = 64,
        check_finite: bool = True,
    ) -> None:
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"FP8Codec supports float8_e4m3fn and float8_e5m2, got {fp8_dtype}")
        if group_tokens is not None and group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1 or None, got {group_tokens}")
        self.fp8_dtype = fp8_dtype
        self.group_tokens = group_tokens
        self.check_finite = self.checks_values = check_finite
        self.fp8_max = float(torch.finfo(fp8_dtype).max)
        self._emax = round(math.log2(self.fp8_max / 1.75))  # fp8_max = 1.75 * 2**emax (the scale kernel's form)
        assert 1.75 * 2.0 ** self._emax == self.fp8_max
        self.name = "fp8_e4m3" if fp8_dtype == torch.float8_e4m3fn else "fp8_e5m2"
        self._luts: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # ----- layout -------------------------------------------------------------------------
    def groups(self, s: int) -> int:
        """Scale groups per (batch, head) for a block of ``s`` tokens."""
        if self.group_tokens is None or s == 0:
            return 1
        return -(-s // self.group_tokens)

    def _layout(self, spec: KVSpec) -> tuple[int, int, int, int]:
        """(K scales, V scales, K payload, V payload) element counts."""
        bk, hk, sk, _ = spec.k_shape
        bv, hv, sv, _ = spec.v_shape
        return bk * hk * self.groups(sk), bv * hv * self.groups(sv), spec.k_numel, spec.v_numel

    def wire_bytes(self, spec: KVSpec) -> int:
        nsk, nsv, nk, nv = self._layout(spec)
        return -(-(4 * (nsk + nsv) + nk + nv) // WIRE_ALIGN) * WIRE_ALIGN

    def new_buffer(self, spec: KVSpec) -> torch.Tensor:
        return torch.empty(self.wire_bytes(spec), dtype=torch.uint8, device=spec.device)

    def _views(
        self, buf: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...], clear_tail: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scale views ``[b, h, g]`` fp32 and payload views ``[b, h, s, d]`` fp8 into ``buf`` (``clear_tail``: the
        encoder's call, which zeroes the alignment tail, if there is one: the same input gives the same bytes)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"FP8 wire buffer must be 1-D uint8, got {buf.dtype} {tuple(buf.shape)}")
        spec = KVSpec(tuple(k_shape), tuple(v_shape), torch.float32, buf.device)  # type: ignore[arg-type]
        nsk, nsv, nk, nv = self._layout(spec)
        if buf.numel() != self.wire_bytes(spec):
            raise ValueError(f"FP8 wire buffer has {buf.numel()} bytes, expected {self.wire_bytes(spec)}")
        end = 4 * (nsk + nsv) + nk + nv
        if clear_tail and end < buf.numel():
            buf[end:].zero_()
        scales = buf[: 4 * (nsk + nsv)].view(torch.float32)
        payload = buf[4 * (nsk + nsv) : end].view(self.fp8_dtype)
        bk, hk, sk, _ = k_shape
        bv, hv, sv, _ = v_shape
        return (
            scales[:nsk].view(bk, hk, self.groups(sk)),
            scales[nsk:].view(bv, hv, self.groups(sv)),
            payload[:nk].view(k_shape),
            payload[nk:].view(v_shape),
        )

    # ----- scales -------------------------------------------------------------------------
    def _row_scale(self, g: torch.Tensor, s: int) -> torch.Tensor:
        """Per-group ``[b, h, g]`` -> broadcastable per-token ``[b, h, s|1, 1]``."""
        if g.shape[-1] == 1 or self.group_tokens == 1:  # one scale per block, or per token already
            return g.unsqueeze(-1)
        return g.repeat_interleave(self.group_tokens, dim=-1)[..., :s].unsqueeze(-1)

    def _scales(self, x: torch.Tensor, what: str, on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 power-of-two scales ``[b, h, g]`` for ``x`` ``[b, h, s, d]`` and the per-group finiteness.
        ``on_device``: never raise (no host read): the scale of a non-finite group is NaN."""
        b, h, s, _ = x.shape
        row = x.abs().amax(dim=-1).float()  # [b, h, s] max |x|; NaN propagates
        gt = self.group_tokens
        if gt is None or gt >= s:
            amax = row.amax(dim=-1, keepdim=True) if s > 0 else row.new_zeros(b, h, 1)
        elif gt == 1:
            amax = row
        else:
            g = self.groups(s)
            if g * gt != s:
                row = torch.nn.functional.pad(row, (0, g * gt - s))
            amax = row.view(b, h, g, gt).amax(dim=-1)
        finite = torch.isfinite(amax)
        if self.check_finite and not on_device and not bool(finite.all()):
            raise WireFiniteError(
                f"{self.name} wire: {what} contains inf/NaN at [b, h, group]={_first_bad(finite)} "
                f"(group = {gt or s} tokens); refusing to quantize (pass check_finite=False to get NaN)"
            )
        return pow2_scales(amax, self._emax, nan_where_not_finite=not self.check_finite or on_device), finite

    # ----- codec --------------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, scale_out: torch.Tensor, payload_out: torch.Tensor, what: str,
                  on_device: bool = False) -> torch.Tensor | None:
        """Quantize ``x`` into the views; returns the device verdict (any group non-finite) when
        ``on_device`` (None for an empty ``x``)."""
        if x.numel() == 0:
            scale_out.fill_(1.0)
            return None
        if self._fused(x) and (on_device or not self.check_finite):
            # the scales as one kernel (.fp8_triton); NaN for a group with inf/NaN, as below
            rows = x.abs().amax(dim=-1)
            args = (rows, scale_out, self.group_tokens or x.shape[2], self._emax)
            inv, bad = (fp8_scales(*args) if self.launch_rule(rows, scale_out)
                        else torch.ops.megatron_ring.fp8_scales(*args))
            payload_out.copy_(torch.mul(x, inv.unsqueeze(-1)))
            return bad.any() if on_device else None
        scale, finite = self._scales(x, what, on_device)
        scale_out.copy_(scale)
        inv = self._row_scale(scale.reciprocal(), x.shape[2])  # exact: powers of two
        # x (any strides, any float dtype) * 2^-e is exact in fp32; the fp8 cast is the only rounding.
        payload_out.copy_(torch.mul(x, inv))
        return ~finite.all() if on_device else None

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s scales are made by the scale kernel (CUDA, where Triton is: ``launch_rule``)."""
        return self.launch_rule is not None and x.device.type == "cuda"

    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        ks, vs, kp, vp = self._views(out, tuple(k.shape), tuple(v.shape), clear_tail=True)
        self._quantize(k, ks, kp, "K")
        self._quantize(v, vs, vp, "V")

    def encode_flagged(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """With ``check_finite``: the non-finite check on the device (the affected groups' scales are
        NaN, so they decode as NaN) and its verdict; without it, :meth:`encode` (nothing checked)."""
        if not self.check_finite:
            self.encode(k, v, out)
            return None
        ks, vs, kp, vp = self._views(out, tuple(k.shape), tuple(v.shape), clear_tail=True)
        flags = [f for f in (self._quantize(k, ks, kp, "K", True), self._quantize(v, vs, vp, "V", True))
                 if f is not None]
        return None if not flags else flags[0] if len(flags) == 1 else flags[0] | flags[1]

    def check_values(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.check_finite:
            for x, what in ((k, "K"), (v, "V")):
                if x.numel():
                    self._scales(x, what)

    def _lut(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """All 256 fp8 codes as ``dtype`` values (exact for fp32/bf16; NaN codes stay NaN)."""
        key = (dtype, device)
        lut = self._luts.get(key)
        if lut is None:
            codes = torch.arange(256, dtype=torch.uint8, device=device).view(self.fp8_dtype)
            lut = self._luts[key] = codes.to(dtype)
        return lut

    def _dequantize(self, scale: torch.Tensor, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        row = self._row_scale(scale, payload.shape[2])
        # fp32/bf16 hold every fp8 value times 2^[-120, 120] exactly: decode directly in `dtype`.
        # fp16 does not (range), so it goes through fp32.
        work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        if payload.device.type == "cpu":
            # torch's scalar fp8->float conversion on CPU is ~5x slower than a 256-entry gather.
            codes = payload.view(torch.uint8).reshape(-1).int()
            x = self._lut(work, payload.device).index_select(0, codes).view(payload.shape)
        else:
            x = payload.to(work)
        x.mul_(row)  # fp32 powers of two: exact in `work` (one op: no cast of the scales first)
        return x if work == dtype else x.to(dtype)

    def decode(self, buf: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs, kp, vp = self._views(buf, spec.k_shape, spec.v_shape)
        return self._dequantize(ks, kp, spec.dtype), self._dequantize(vs, vp, spec.dtype)


#: THE table of wire dtypes: every accepted string spelling of ``comm_dtype`` (case-insensitive; a
#: ``torch.`` prefix is allowed) and the dtype it means (None: K/V travel as computed). ``ring_attention``,
#: Megatron's ``--cp-comm-dtype``, the benchmark's and the planner's ``--comm-dtype`` all accept exactly these.
COMM_DTYPE_ALIASES: dict[str, torch.dtype | None] = {
    "none": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}

_ACCEPTED = (
    "None, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, "
    f"or one of the strings {sorted(COMM_DTYPE_ALIASES)}"
)


def wire_dtype(comm_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The wire dtype ``comm_dtype`` means (a spelling of :data:`COMM_DTYPE_ALIASES`, a dtype or None);
    ValueError naming the accepted values otherwise."""
    if isinstance(comm_dtype, str):
        key = comm_dtype.strip().lower().removeprefix("torch.")
        if key not in COMM_DTYPE_ALIASES:
            raise ValueError(f"comm_dtype={comm_dtype!r} is not supported; use {_ACCEPTED}")
        return COMM_DTYPE_ALIASES[key]
    if comm_dtype is None or comm_dtype in COMM_DTYPE_ALIASES.values():
        return comm_dtype
    raise ValueError(f"comm_dtype={comm_dtype} is not supported; use {_ACCEPTED}")


def make_codec(comm_dtype: torch.dtype | str | None, compute_dtype: torch.dtype) -> KVCodec:
    """The codec for a wire dtype.

    ``None``/``"none"`` (or the compute dtype itself) sends K/V unchanged (:class:`IdentityCodec`);
    fp32/bf16/fp16 -> :class:`CastCodec`; ``float8_e4m3fn`` (``"fp8"``) / ``float8_e5m2`` ->
    :class:`FP8Codec` with the default scale granularity. The wire format depends only on
    ``comm_dtype``; ``compute_dtype`` is what receivers decode into.
    """
    comm_dtype = wire_dtype(comm_dtype)
    if comm_dtype is None or comm_dtype == compute_dtype:
        return IdentityCodec()
    if comm_dtype in (torch.float32, torch.bfloat16, torch.float16):
        return CastCodec(comm_dtype)
    if comm_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return FP8Codec(comm_dtype)
    raise ValueError(f"comm_dtype={comm_dtype} is not supported; use {_ACCEPTED}")
