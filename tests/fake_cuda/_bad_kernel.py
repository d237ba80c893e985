"""A Triton kernel the compiler refuses (tests/fake_cuda/test_triton_kernels.py, its negative control): ``x`` is a
block in one branch and a scalar of another type in the other."""
import triton
import triton.language as tl


@triton.jit
def bad(out, flag, BLOCK: tl.constexpr):
    x = tl.zeros((BLOCK,), dtype=tl.float32)
    if flag == 1:
        x = 1
    tl.store(out + tl.arange(0, BLOCK), x)
