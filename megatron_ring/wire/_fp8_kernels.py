"""The Triton kernel of :mod:`.fp8_triton` (imported, with Triton, at the first launch only; the interpreter tests
re-import it under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads when it decorates)."""
import triton
import triton.language as tl


@triton.jit
def _own_larger(a, b):
    return tl.maximum(a, b)


# The combine function of the reductions: Triton's own, that of ``tl.max`` (the same body as the fallback above),
# passed to ``tl.reduce`` (a builtin): ``tl.max`` is a jitted wrapper, which Triton's interpreter cannot call when
# Triton was imported before it was asked for. The interpreter reduces with numpy for Triton's own, element by
# element in Python for a kernel's own.
_larger = getattr(tl.standard, "_elementwise_max", _own_larger)


@triton.jit
def fp8_scales_kernel(R, S, INV, BAD, s_rb, s_rh, s_rn, s_sb, s_sh, s_sg, H, N, G, GT, EMAX,
                      MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (batch row x head, group of ``GT`` tokens): the group's power-of-two scale
    ``2^ceil(log2(amax / fp8_max))`` with ``fp8_max = 1.75 * 2^EMAX``, clamped to ``2^[-120, 120]`` (1 where
    ``amax == 0``), NaN where the group holds inf/NaN; written to ``S`` ``[b, h, g]`` (strided), its reciprocal to
    every row of the group in ``INV`` (``[b, h, N]`` dense fp32) and the group's verdict to ``BAD`` (``[b * h * G]``).

    ``R``: each token row's max |x| (``[b, h, N]``, NaN where the row has one) as ``MODE`` says: 0 the bits of fp32
    values (an int32 view), 1 the bits of bf16 values (an int16 view), 2 fp16 values. Everything is integer
    arithmetic on the fp32 bit patterns (non-negative floats order as their bits; no float conversion but fp16's,
    which is exact), so a GPU that flushes subnormals in float arithmetic gives the same scales as the reference."""
    bh = tl.program_id(0)
    gi = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = gi * GT
    top = tl.full([], 0, tl.int32)  # the largest finite row max, as its bits
    bad = tl.full([], 0, tl.int32)
    for r0 in range(0, GT, BLOCK):
        rows = start + r0 + tl.arange(0, BLOCK)
        ok = (rows < start + GT) & (rows < N)
        at = R + b * s_rb + h * s_rh + rows * s_rn
        if MODE == 0:
            bits = tl.load(at, mask=ok, other=0) & 0x7FFFFFFF
        elif MODE == 1:
            bits = (tl.load(at, mask=ok, other=0).to(tl.int32) & 0x7FFF) << 16
        else:
            bits = tl.load(at, mask=ok, other=0.0).to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        nonfinite = ((bits >> 23) & 0xFF) == 0xFF  # inf or NaN
        bits = tl.where(nonfinite, 0, bits)
        top = tl.maximum(top, tl.reduce(bits, 0, _larger))
        bad = tl.maximum(bad, tl.reduce(nonfinite.to(tl.int32), 0, _larger))
    field = (top >> 23) & 0xFF
    mant = top & 0x7FFFFF
    # a subnormal max: its mantissa as an integer, converted exactly, gives the exponent and the normalised mantissa
    sub = mant.to(tl.float32).to(tl.int32, bitcast=True)
    ea = tl.where(field == 0, ((sub >> 23) & 0xFF) - 127 - 149, field - 127)
    frac = tl.where(field == 0, sub & 0x7FFFFF, mant)
    e = ea - EMAX + tl.where(frac > 0x600000, 1, 0)  # mantissa over 1.75: one power more
    e = tl.where(top == 0, 0, tl.minimum(tl.maximum(e, -120), 120))
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bad > 0, float("nan"), scale)
    inv = tl.where(bad > 0, float("nan"), inv)
    tl.store(S + b * s_sb + h * s_sh + gi * s_sg, scale)
    for r0 in range(0, GT, BLOCK):
        rows = start + r0 + tl.arange(0, BLOCK)
        ok = (rows < start + GT) & (rows < N)
        tl.store(INV + bh * N + rows, tl.full([BLOCK], 0.0, tl.float32) + inv, mask=ok)
    tl.store(BAD + bh * G + gi, bad.to(tl.int8))
