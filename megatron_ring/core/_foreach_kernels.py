"""The Triton kernel of :mod:`.foreach_triton` (imported, with Triton, at the first launch only; the interpreter
tests re-import it under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads when it decorates)."""
import triton
import triton.language as tl


@triton.jit
def foreach_entry(pid, first, mode, dst, src, n, d1, d2, d3, a0, a1, a2, a3, b0, b1, b2, b3, BLOCK: tl.constexpr):
    """Block ``pid - first`` of one pair: ``n`` elements of a ``[*, d1, d2, d3]`` shape, strides ``a`` (dst)
    and ``b`` (src); ``mode`` 0: copy, 1: add, 2: zero (src not read)."""
    i = (pid - first).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: entries over 2**31 elements
    keep = i < n
    i3 = i % d3
    r = i // d3
    i2 = r % d2
    r = r // d2
    i1 = r % d1
    i0 = r // d1
    x = tl.load(src + i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3, mask=keep & (mode != 2), other=0.0).to(tl.float32)
    at = dst + i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3
    if mode == 1:
        x = tl.load(at, mask=keep, other=0.0).to(tl.float32) + x
    tl.store(at, x.to(dst.dtype.element_ty), mask=keep)


@triton.jit
def foreach_kernel(dst0, src0, m0, n0, e0, p0, q0, r0, a00, a01, a02, a03, b00, b01, b02, b03,
                   dst1, src1, m1, n1, e1, p1, q1, r1, a10, a11, a12, a13, b10, b11, b12, b13,
                   dst2, src2, m2, n2, e2, p2, q2, r2, a20, a21, a22, a23, b20, b21, b22, b23,
                   dst3, src3, m3, n3, e3, p3, q3, r3, a30, a31, a32, a33, b30, b31, b32, b33,
                   N: tl.constexpr, BLOCK: tl.constexpr):
    """Up to 4 pairs (``N`` used); ``eK``: the end (exclusive) of pair K's blocks in the grid."""
    pid = tl.program_id(0)
    if pid < e0:
        foreach_entry(pid, 0, m0, dst0, src0, n0, p0, q0, r0, a00, a01, a02, a03, b00, b01, b02, b03, BLOCK)
    if N > 1:
        if (pid >= e0) & (pid < e1):
            foreach_entry(pid, e0, m1, dst1, src1, n1, p1, q1, r1, a10, a11, a12, a13, b10, b11, b12, b13, BLOCK)
    if N > 2:
        if (pid >= e1) & (pid < e2):
            foreach_entry(pid, e1, m2, dst2, src2, n2, p2, q2, r2, a20, a21, a22, a23, b20, b21, b22, b23, BLOCK)
    if N > 3:
        if pid >= e2:
            foreach_entry(pid, e2, m3, dst3, src3, n3, p3, q3, r3, a30, a31, a32, a33, b30, b31, b32, b33, BLOCK)
