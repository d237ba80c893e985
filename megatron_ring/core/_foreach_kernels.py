"""The Triton kernel of :mod:`.foreach_triton` (imported, with Triton, at the first launch only; the interpreter
tests re-import it under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads when it decorates)."""
import triton
import triton.language as tl


@triton.jit
def foreach_entry(pid, first, mode, dst, src, R, C, d1, d2, a0, a1, a2, a3, b0, b1, b2, b3,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``pid - first`` of one pair seen as ``R`` rows of ``C`` elements (a ``[*, d1, d2, C]`` shape;
    strides ``a`` of dst, ``b`` of src): a tile of ``BLOCK_R`` rows by ``BLOCK_C`` columns (the pair's programs
    run over its row tiles, each over its column chunks); the row offsets are found once per row. ``mode`` 0:
    copy, 1: add, 2: zero (src not read), 3: copy with -inf made +inf."""
    local = (pid - first).to(tl.int64)  # 64-bit: tensors over 2**31 elements
    chunks = (C + BLOCK_C - 1) // BLOCK_C
    r = (local // chunks) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (local % chunks) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    i2 = r % d2
    t = r // d2
    i1 = t % d1
    i0 = t // d1
    keep = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(src + (i0 * b0 + i1 * b1 + i2 * b2)[:, None] + c[None, :] * b3, mask=keep & (mode != 2),
                other=0.0).to(tl.float32)
    at = dst + (i0 * a0 + i1 * a1 + i2 * a2)[:, None] + c[None, :] * a3
    if mode == 1:
        x = tl.load(at, mask=keep, other=0.0).to(tl.float32) + x
    if mode == 3:
        x = tl.where(x == float("-inf"), float("inf"), x)
    tl.store(at, x.to(dst.dtype.element_ty), mask=keep)


@triton.jit
def foreach_kernel(dst0, src0, m0, R0, e0, C0, p0, q0, a00, a01, a02, a03, b00, b01, b02, b03,
                   dst1, src1, m1, R1, e1, C1, p1, q1, a10, a11, a12, a13, b10, b11, b12, b13,
                   dst2, src2, m2, R2, e2, C2, p2, q2, a20, a21, a22, a23, b20, b21, b22, b23,
                   dst3, src3, m3, R3, e3, C3, p3, q3, a30, a31, a32, a33, b30, b31, b32, b33,
                   N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Up to 4 pairs (``N`` used); ``eK``: the end (exclusive) of pair K's programs in the grid."""
    pid = tl.program_id(0)
    if pid < e0:
        foreach_entry(pid, 0, m0, dst0, src0, R0, C0, p0, q0, a00, a01, a02, a03, b00, b01, b02, b03,
                      BLOCK_R, BLOCK_C)
    if N > 1:
        if (pid >= e0) & (pid < e1):
            foreach_entry(pid, e0, m1, dst1, src1, R1, C1, p1, q1, a10, a11, a12, a13, b10, b11, b12, b13,
                          BLOCK_R, BLOCK_C)
    if N > 2:
        if (pid >= e1) & (pid < e2):
            foreach_entry(pid, e1, m2, dst2, src2, R2, C2, p2, q2, a20, a21, a22, a23, b20, b21, b22, b23,
                          BLOCK_R, BLOCK_C)
    if N > 3:
        if pid >= e2:
            foreach_entry(pid, e2, m3, dst3, src3, R3, C3, p3, q3, a30, a31, a32, a33, b30, b31, b32, b33,
                          BLOCK_R, BLOCK_C)
