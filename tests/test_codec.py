"""Wire codecs on their own: round trips, error bounds, bytes, edge values, and a gloo hop.

Per-element error bounds (see docs/numerics.md), ``x`` the input, ``x_hat`` the decoded value,
``scale`` the power-of-two scale of x's FP8 group (read back from the wire buffer):

* bf16 wire: ``|x_hat - x| <= 2^-8 |x|``      (fp16 wire: ``2^-11 |x| + 2^-25``)
* fp8 e4m3:  ``|x_hat - x| <= 2^-4 |x| + 2^-10 scale``, ``scale <= max(amax_group / 224, 2^-120)``
* fp8 e5m2:  ``|x_hat - x| <= 2^-3 |x| + 2^-17 scale``, ``scale <= max(amax_group / 28672, 2^-120)``

plus, when decoding into fp16, fp16's own rounding (``2^-11 |x| + 2^-25``).
"""
from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.launch import run_distributed

from megatron_ring.wire.codecs import CastCodec, FP8Codec, IdentityCodec, KVCodec, KVSpec, WIRE_ALIGN, make_codec
from megatron_ring.errors import WireFiniteError

torch.set_num_threads(1)

COMPUTE = [torch.float32, torch.bfloat16, torch.float16]
CPU = torch.device("cpu")

# (relative, absolute-in-units-of-scale) rounding bound and amax/scale lower limit per fp8 format.
FP8_BOUNDS = {
    torch.float8_e4m3fn: (2.0**-4, 2.0**-10, 224.0),
    torch.float8_e5m2: (2.0**-3, 2.0**-17, 28672.0),
}
CAST_REL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}


def spec_of(k: torch.Tensor, v: torch.Tensor) -> KVSpec:
    return KVSpec(tuple(k.shape), tuple(v.shape), k.dtype, k.device)


def roundtrip(codec: KVCodec, k: torch.Tensor, v: torch.Tensor):
    spec = spec_of(k, v)
    buf = codec.new_buffer(spec)
    codec.encode(k, v, buf)
    kd, vd = codec.decode(buf, spec)
    return buf, kd, vd


def fp8_group_scales(codec: FP8Codec, buf: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales ``[b, h, s, 1]`` for K and V, read back from the wire buffer."""
    ks, vs, _, _ = codec._views(buf, spec.k_shape, spec.v_shape)
    return codec._row_scale(ks, spec.k_shape[2]), codec._row_scale(vs, spec.v_shape[2])


def assert_fp8_bound(codec: FP8Codec, x: torch.Tensor, xd: torch.Tensor, scale_row: torch.Tensor) -> None:
    rel, abs_units, _ = FP8_BOUNDS[codec.fp8_dtype]
    x32, xd32 = x.float(), xd.float()
    bound = rel * x32.abs() + abs_units * scale_row
    if xd.dtype == torch.float16:
        bound = bound + 2.0**-11 * x32.abs() + 2.0**-25
    err = (xd32 - x32).abs()
    assert torch.isfinite(xd32).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"


def check_scales(codec: FP8Codec, x: torch.Tensor, scale_row: torch.Tensor) -> None:
    """Scales are finite powers of two with amax/scale in [fp8_max/2, fp8_max) (or clamped)."""
    _, _, lo = FP8_BOUNDS[codec.fp8_dtype]
    assert torch.isfinite(scale_row).all() and (scale_row > 0).all()
    mant, _ = torch.frexp(scale_row)
    assert (mant == 0.5).all(), "scales must be powers of two"
    row_amax = x.float().abs().amax(dim=-1, keepdim=True)
    assert (row_amax <= codec.fp8_max * scale_row).all()
    # group amax >= lo * scale unless the group is all zero (scale 1) or clamped at 2^-120
    g_amax = _group_amax(codec, x)
    ok = (g_amax >= lo * scale_row) | (g_amax == 0) | (scale_row == 2.0**-120)
    assert ok.all()


def _group_amax(codec: FP8Codec, x: torch.Tensor) -> torch.Tensor:
    """Per-token view ``[b, h, s, 1]`` of each token's group amax."""
    b, h, s, _ = x.shape
    row = x.float().abs().amax(dim=-1)
    gt = codec.group_tokens
    if gt is None or gt >= s:
        g = row.amax(dim=-1, keepdim=True)
    else:
        n = codec.groups(s)
        g = torch.nn.functional.pad(row, (0, n * gt - s)).view(b, h, n, gt).amax(-1)
    return codec._row_scale(g, s)


# ----------------------------------------------------------------------------------------------
# make_codec


@pytest.mark.parametrize(
    "comm, compute, cls, wire",
    [
        (None, torch.float32, IdentityCodec, None),
        ("none", torch.bfloat16, IdentityCodec, None),
        (torch.bfloat16, torch.float32, CastCodec, torch.bfloat16),
        ("bf16", torch.float16, CastCodec, torch.bfloat16),
        ("BF16", torch.bfloat16, IdentityCodec, None),  # same as compute: nothing to do
        ("fp16", torch.float32, CastCodec, torch.float16),
        (torch.float16, torch.bfloat16, CastCodec, torch.float16),
        ("fp8", torch.float32, FP8Codec, torch.float8_e4m3fn),
        ("torch.float8_e4m3fn", torch.bfloat16, FP8Codec, torch.float8_e4m3fn),
        (torch.float8_e4m3fn, torch.float16, FP8Codec, torch.float8_e4m3fn),
        ("e5m2", torch.float32, FP8Codec, torch.float8_e5m2),
        (torch.float8_e5m2, torch.bfloat16, FP8Codec, torch.float8_e5m2),
    ],
)
def test_make_codec_mapping(comm, compute, cls, wire) -> None:
    c = make_codec(comm, compute)
    assert type(c) is cls
    if cls is CastCodec:
        assert c.wire_dtype == wire
    if cls is FP8Codec:
        assert c.fp8_dtype == wire


@pytest.mark.parametrize("bad", ["int8", "fp4", torch.int8, torch.float64, "bf 16"])
def test_make_codec_rejects_unknown(bad) -> None:
    with pytest.raises(ValueError, match="bfloat16.*float8_e4m3fn"):
        make_codec(bad, torch.float32)


# ----------------------------------------------------------------------------------------------
# round trips: shapes, GQA, odd head dims, non-contiguous inputs, all compute dtypes

SHAPES = [
    # (k_shape, v_shape)
    ((2, 4, 64, 64), (2, 4, 64, 64)),
    ((1, 2, 130, 80), (1, 2, 130, 80)),  # GQA-sized kv heads, d=80, s not a multiple of 64
    ((1, 1, 1, 16), (1, 1, 1, 16)),  # single token
    ((2, 1, 33, 128), (2, 1, 33, 96)),  # MQA, V head dim != K head dim
]


def make_kv(k_shape, v_shape, dtype, layout: str, seed: int = 0):
    """K/V ``[b, h, s, d]`` in ``dtype``; ``layout`` picks the memory layout of the view."""
    g = torch.Generator().manual_seed(seed)

    def one(shape):
        b, h, s, d = shape
        if layout == "bshd":  # Megatron-style [b, s, h, d] memory, transposed view
            return torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2)
        if layout == "strided":  # every other token and a sliced head dim
            return torch.randn(b, h, 2 * s, d + 3, generator=g).to(dtype)[:, :, ::2, 1 : d + 1]
        return torch.randn(b, h, s, d, generator=g).to(dtype)

    return one(k_shape), one(v_shape)


@pytest.mark.parametrize("compute", COMPUTE, ids=str)
@pytest.mark.parametrize("comm", ["bf16", "fp16", "fp8", "e5m2"])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + "_v" + str(s[1][-1]))
@pytest.mark.parametrize("layout", ["contig", "bshd", "strided"])
def test_roundtrip(comm: str, compute: torch.dtype, shapes, layout: str) -> None:
    k, v = make_kv(*shapes, compute, layout)
    assert layout == "contig" or min(k.shape[1:3]) == 1 or not k.is_contiguous()
    k0, v0 = k.clone(), v.clone()
    codec = make_codec(comm, compute)
    spec = spec_of(k, v)
    buf, kd, vd = roundtrip(codec, k, v)

    # one flat buffer, exactly wire_bytes long; inputs untouched
    assert isinstance(buf, torch.Tensor) and buf.dim() == 1
    assert buf.numel() * buf.element_size() == codec.wire_bytes(spec)
    assert KVCodec.wire_bytes(codec, spec) == codec.wire_bytes(spec)  # meta-device computation agrees
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert kd.shape == k.shape and vd.shape == v.shape
    assert kd.dtype == compute and vd.dtype == compute

    if isinstance(codec, FP8Codec):
        assert buf.dtype == torch.uint8
        ks, vs = fp8_group_scales(codec, buf, spec)
        for x, xd, sc in ((k, kd, ks), (v, vd, vs)):
            check_scales(codec, x, sc)
            assert_fp8_bound(codec, x, xd, sc)
    elif isinstance(codec, CastCodec):
        assert buf.dtype == codec.wire_dtype
        rel = CAST_REL[codec.wire_dtype] + (2.0**-11 if compute == torch.float16 else 0.0)
        for x, xd in ((k, kd), (v, vd)):
            err = (xd.float() - x.float()).abs()
            assert (err <= rel * x.float().abs() + 2.0**-25).all()
    else:  # same dtype as compute -> identity, exact
        assert torch.equal(kd, k) and torch.equal(vd, v)

    # deterministic: re-encoding into a used buffer gives the same bytes
    buf2 = codec.new_buffer(spec)
    codec.encode(k, v, buf2)
    assert torch.equal(buf.view(torch.uint8), buf2.view(torch.uint8))


@pytest.mark.parametrize("group_tokens", [None, 1, 7, 64, 1000])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_granularities(group_tokens, fp8) -> None:
    k, v = make_kv((2, 3, 100, 64), (2, 3, 100, 64), torch.float32, "bshd", seed=1)
    codec = FP8Codec(fp8, group_tokens=group_tokens)
    spec = spec_of(k, v)
    buf, kd, vd = roundtrip(codec, k, v)
    n_groups = 1 if group_tokens is None else math.ceil(100 / group_tokens)
    assert buf.numel() == 2 * (2 * 3 * 100 * 64) + 4 * 2 * (2 * 3 * n_groups)
    ks, vs = fp8_group_scales(codec, buf, spec)
    for x, xd, sc in ((k, kd, ks), (v, vd, vs)):
        check_scales(codec, x, sc)
        assert_fp8_bound(codec, x, xd, sc)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_exact_on_representable_values(fp8) -> None:
    """Powers-of-two scales: fp8-representable values times 2^k survive the round trip bit-exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    codes = codes[torch.isfinite(codes)]
    g = torch.Generator().manual_seed(3)
    vals = codes[torch.randint(len(codes), (1, 4, 64, 32), generator=g)]
    vals[..., 0, 0] = torch.finfo(fp8).max  # amax exactly fp8_max -> scale 1, nothing moves
    for compute in COMPUTE:
        mult = [2.0**-40, 1.0, 2.0**10, 2.0**60] if compute != torch.float16 else [2.0**-8, 1.0, 0.5, 1.0]
        kk = (vals * torch.tensor(mult).view(1, 4, 1, 1)).to(compute)
        assert torch.isfinite(kk).all()
        _, kd, vd = roundtrip(FP8Codec(fp8), kk, kk)
        assert torch.equal(kd, kk) and torch.equal(vd, kk)


# ----------------------------------------------------------------------------------------------
# extreme values


@pytest.mark.parametrize("compute", COMPUTE, ids=str)
@pytest.mark.parametrize("comm", ["bf16", "fp16", "fp8", "e5m2"])
def test_zeros(comm, compute) -> None:
    k = torch.zeros(1, 2, 70, 64, dtype=compute)
    v = torch.zeros(1, 2, 70, 64, dtype=compute)
    v[:, 1, 5] = 1.5  # one non-zero token in one head; the other groups stay all-zero
    codec = make_codec(comm, compute)
    buf, kd, vd = roundtrip(codec, k, v)
    assert torch.equal(kd, k) and torch.equal(vd, v)
    if isinstance(codec, FP8Codec):
        scales = buf[: 4 * 2 * 2 * codec.groups(70)].view(torch.float32)
        assert torch.isfinite(scales).all() and (scales > 0).all()


@pytest.mark.parametrize("compute", COMPUTE, ids=str)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_large_and_tiny_magnitudes(compute, fp8) -> None:
    """Each head spans its own magnitude; no overflow, no inf/NaN, bound holds per element."""
    fmax = torch.finfo(compute).max
    mags = {
        torch.float32: [3.0e38, 1e30, 1.0, 1e-30, 1e-38, 1e-44],
        torch.bfloat16: [3.0e38, 1e20, 1.0, 1e-20, 1e-38, 1e-39],
        torch.float16: [6.0e4, 1e3, 1.0, 1e-3, 1e-6, 1e-7],
    }[compute]
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, len(mags), 96, 64, generator=g)
    base = base / base.abs().amax(dim=(-2, -1), keepdim=True)  # |base| <= 1
    k = (base * torch.tensor(mags).view(1, -1, 1, 1)).to(compute)
    assert torch.isfinite(k).all() and k.abs().max() <= fmax
    codec = FP8Codec(fp8)
    spec = spec_of(k, k)
    buf, kd, _ = roundtrip(codec, k, k)
    ks, _ = fp8_group_scales(codec, buf, spec)
    check_scales(codec, k, ks)
    assert_fp8_bound(codec, k, kd, ks)
    # relative error is format-limited for every head whose values are far from the 2^-120 floor
    rel, _, _ = FP8_BOUNDS[fp8]
    for h, m in enumerate(mags):
        if m >= 1e-30 and compute != torch.float16:
            num = (kd[0, h].double() - k[0, h].double()).norm()
            assert num <= rel * k[0, h].double().norm()


def test_fp8_mixed_scale_tokens_are_isolated_by_groups() -> None:
    """A spike in one 64-token group does not cost precision in the other groups."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn(1, 1, 256, 64, generator=g)
    k[0, 0, 3] *= 1e6  # group 0 holds a token 1e6 x larger
    codec = FP8Codec(group_tokens=64)
    spec = spec_of(k, k)
    buf, kd, _ = roundtrip(codec, k, k)
    ks, _ = fp8_group_scales(codec, buf, spec)
    assert_fp8_bound(codec, k, kd, ks)
    err = (kd - k).abs()
    assert (err[0, 0, 64:] <= 2.0**-4 * k[0, 0, 64:].abs()).all()  # other groups: purely relative
    # within group 0 the other tokens fall to fp8 subnormals/zero: bounded by 2^-10 * scale
    small = torch.cat([err[0, 0, :3], err[0, 0, 4:64]])
    assert small.max() <= 2.0**-10 * ks[0, 0, 0, 0]


def test_fp8_mixed_scale_heads() -> None:
    g = torch.Generator().manual_seed(8)
    s = torch.tensor([1e-20, 1e-3, 1.0, 1e3, 1e20]).view(1, 5, 1, 1)
    k = torch.randn(2, 5, 64, 32, generator=g) * s
    _, kd, _ = roundtrip(FP8Codec(group_tokens=None), k, k)
    kd, k = kd.double(), k.double()
    rel = (kd - k).norm(dim=(-2, -1)) / k.norm(dim=(-2, -1))
    assert (rel < 0.04).all(), rel  # per-head scale: every head keeps fp8's ~2.7% rms error


# ----------------------------------------------------------------------------------------------
# inf / NaN


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("which", ["K", "V"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_nonfinite_raises(bad, which, fp8) -> None:
    k = torch.randn(1, 2, 130, 64)
    v = torch.randn(1, 2, 130, 64)
    (k if which == "K" else v)[0, 1, 100, 7] = bad
    codec = FP8Codec(fp8)
    with pytest.raises(WireFiniteError, match=rf"{which} contains inf/NaN at \[b, h, group\]=\(0, 1, 1\)"):
        roundtrip(codec, k, v)
    assert issubclass(WireFiniteError, ValueError)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("compute", COMPUTE, ids=str)
def test_fp8_nonfinite_propagates_when_unchecked(bad, compute) -> None:
    """check_finite=False: the affected group decodes to NaN (never a saturated finite value)."""
    k = torch.randn(1, 2, 130, 64).to(compute)
    k[0, 1, 100, 7] = bad
    _, kd, vd = roundtrip(FP8Codec(check_finite=False), k, k.clone())
    nan = torch.isnan(kd)
    assert nan[0, 1, 64:128].all()  # the whole (b=0, h=1, tokens 64..127) group
    assert not nan[0, 0].any() and not nan[0, 1, :64].any() and not nan[0, 1, 128:].any()
    assert torch.equal(torch.isnan(vd), nan)


@pytest.mark.parametrize("compute", [torch.float32, torch.float16], ids=str)
def test_bf16_wire_carries_nonfinite(compute) -> None:
    k = torch.randn(1, 1, 8, 16).to(compute)
    k[0, 0, 1, 2], k[0, 0, 3, 4], k[0, 0, 5, 6] = math.inf, -math.inf, math.nan
    _, kd, _ = roundtrip(make_codec("bf16", compute), k, k)
    assert kd[0, 0, 1, 2] == math.inf and kd[0, 0, 3, 4] == -math.inf and torch.isnan(kd[0, 0, 5, 6])
    assert torch.isfinite(kd).sum() == k.numel() - 3


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
def test_fp16_wire_overflow_raises(compute) -> None:
    k = torch.randn(1, 2, 8, 16).to(compute)
    k[0, 1, 2, 3] = 1e5
    with pytest.raises(WireFiniteError, match=r"fp16 wire: K .*\(0, 1, 2, 3\)"):
        roundtrip(make_codec("fp16", compute), k, torch.zeros_like(k))
    k[0, 0, 0, 0] = math.nan  # a NaN elsewhere does not mask the overflow
    with pytest.raises(WireFiniteError, match=r"\(0, 1, 2, 3\)"):
        roundtrip(make_codec("fp16", compute), k, torch.zeros_like(k))
    k[0, 1, 2, 3] = math.inf  # genuine inf is carried (as the identity wire would)
    _, kd, _ = roundtrip(make_codec("fp16", compute), k, torch.zeros_like(k))
    assert kd[0, 1, 2, 3] == math.inf and torch.isnan(kd[0, 0, 0, 0])


# ----------------------------------------------------------------------------------------------
# bytes on the wire


@pytest.mark.parametrize(
    "k_shape",
    [(1, 8, 1024, 64), (1, 8, 2048, 128), (2, 2, 512, 80), (1, 1, 64, 32), (4, 8, 1, 64)],
)
def test_wire_byte_ratios(k_shape) -> None:
    """Per forward ring step, scales included: bf16 <= 0.55x and fp8 <= 0.30x of fp32 K/V bytes."""
    spec = KVSpec(k_shape, k_shape, torch.float32, CPU)
    fp32 = make_codec(None, torch.float32).wire_bytes(spec)
    assert fp32 == 2 * 4 * math.prod(k_shape)
    for compute in COMPUTE:
        spec_c = KVSpec(k_shape, k_shape, compute, CPU)
        assert make_codec("bf16", compute).wire_bytes(spec_c) / fp32 <= 0.55
        for name in ("fp8", "e5m2"):
            c = make_codec(name, compute)
            assert c.wire_bytes(spec_c) / fp32 <= 0.30
            # wire format independent of compute dtype
            assert c.wire_bytes(spec_c) == make_codec(name, torch.float32).wire_bytes(spec)
            assert c.wire_bytes(spec_c) == c.new_buffer(spec_c).numel()


def test_wire_bytes_formula() -> None:
    spec = KVSpec((2, 4, 130, 64), (2, 4, 130, 80), torch.bfloat16, CPU)
    nk, nv = 2 * 4 * 130 * 64, 2 * 4 * 130 * 80
    assert FP8Codec(group_tokens=64).wire_bytes(spec) == nk + nv + 4 * 2 * (2 * 4 * 3)
    assert FP8Codec(group_tokens=None).wire_bytes(spec) == nk + nv + 4 * 2 * (2 * 4)
    assert FP8Codec(group_tokens=1).wire_bytes(spec) == nk + nv + 4 * 2 * (2 * 4 * 130)
    assert CastCodec(torch.bfloat16).wire_bytes(spec) == 2 * (nk + nv)
    assert IdentityCodec().wire_bytes(spec) == 2 * (nk + nv)
    odd = KVSpec((1, 2, 3, 9), (1, 2, 3, 16), torch.bfloat16, CPU)  # 150 payload + 16 scale bytes: rounded up to 176
    assert FP8Codec(group_tokens=64).wire_bytes(odd) == 176 == -(-(2 * 3 * 25 + 4 * 2 * 2) // WIRE_ALIGN) * WIRE_ALIGN


def test_fp8_buffers_laid_back_to_back_decode():
    """all_gather's chunks and a2a's splits lay one FP8 buffer per rank back to back in one tensor: with a payload
    that is not a multiple of 4 bytes (head dims 9 and 16) the next buffer's fp32 scales started unaligned
    ("storage_offset() must be divisible by 4"; a crash on one rank, the others waited out the timeout). Each
    buffer is a multiple of WIRE_ALIGN bytes, and its alignment tail is zeroed by the encoder."""
    g = torch.Generator().manual_seed(3)
    c = FP8Codec()
    blocks = [(torch.randn(1, 2, 3, 9, generator=g), torch.randn(1, 2, 3, 16, generator=g)) for _ in range(3)]
    spec = spec_of(*blocks[0])
    n = c.wire_bytes(spec)
    assert n % WIRE_ALIGN == 0 and n > 2 * 3 * 25 + 16
    flat = torch.full((3 * n,), 7, dtype=torch.uint8)
    for (k, v), buf in zip(blocks, flat.chunk(3)):
        c.encode(k, v, buf)
    for (k, v), buf in zip(blocks, flat.chunk(3)):
        assert torch.equal(buf[2 * 3 * 25 + 16:], torch.zeros(n - 2 * 3 * 25 - 16, dtype=torch.uint8))
        kd, vd = c.decode(buf, spec)
        assert (kd - k).abs().max() <= 2 ** -3 * k.abs().max() and (vd - v).abs().max() <= 2 ** -3 * v.abs().max()


def test_fp8_decode_rejects_wrong_buffer() -> None:
    spec = KVSpec((1, 2, 8, 16), (1, 2, 8, 16), torch.float32, CPU)
    c = FP8Codec()
    with pytest.raises(ValueError, match="1-D uint8"):
        c.decode(torch.zeros(c.wire_bytes(spec), dtype=torch.float32), spec)
    with pytest.raises(ValueError, match="bytes"):
        c.decode(torch.zeros(c.wire_bytes(spec) + 1, dtype=torch.uint8), spec)


# ----------------------------------------------------------------------------------------------
# through gloo: isend/irecv (and all_gather of the uint8 buffer) between two processes


def _gloo_worker(rank: int, world: int) -> bool:
    """Rank 0 sends its encoded block; rank 1 checks the bytes and the decode are identical."""
    import torch.distributed as dist

    for comm in ("fp8", "e5m2", "bf16"):
        for compute in (torch.float32, torch.bfloat16):
            codec = make_codec(comm, compute)
            # both ranks build rank 0's block and its encoding, so rank 1 can compare
            k, v = make_kv((1, 2, 100, 80), (1, 2, 100, 80), compute, "bshd", seed=11)
            spec = spec_of(k, v)
            local = codec.new_buffer(spec)
            codec.encode(k, v, local)
            recv = codec.new_buffer(spec)
            if rank == 0:
                dist.isend(local, dst=1).wait()
            else:
                dist.irecv(recv, src=0).wait()
                assert torch.equal(recv.view(torch.uint8), local.view(torch.uint8))
                kr, vr = codec.decode(recv, spec)
                kl, vl = codec.decode(local, spec)
                assert torch.equal(kr, kl) and torch.equal(vr, vl)
            if isinstance(codec, FP8Codec):  # collectives take the uint8 buffer as is
                gathered = [torch.empty_like(local) for _ in range(world)]
                dist.all_gather(gathered, local)
                assert all(torch.equal(g, local) for g in gathered)
    return True


@pytest.mark.slow
def test_wire_buffers_through_gloo() -> None:
    assert run_distributed(_gloo_worker, 2, timeout=120) == [True, True]
