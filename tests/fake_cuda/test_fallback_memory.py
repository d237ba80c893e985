"""The largest tensor a call makes on the CUDA path when its blocks run on the math kernels, at real sizes.

fp32 inputs on CUDA (which cuDNN and flash do not take), GPUs before sm80, head dims over 256, and masked blocks
that fall back run on the math kernel, which materialises fp32 scores; fp32 dropout runs the torch dropout kernel,
which also holds int64 hashes. Before row tiles (kernels/math_kernel.py ``row_tiles``) a zigzag block at 8K tokens
per rank, 2 x 32 heads, made 4 GiB of scores in one tensor (16K tokens per rank: 16 GiB). Traced on the fake-CUDA
tier (FakeTensorMode, the fake CUDA device, :class:`LoopbackRing` rank 1, ``kernel="auto"``: nothing is allocated,
so real sizes cost nothing), a dispatch mode records the largest result of any device op of a forward + backward
call: it must be at most the math kernels' score budget (``SCORE_BUDGET`` fp32 elements, 256 MiB) or the largest of
the call's inputs and gradients. The control reruns each case with a budget of the whole block and sees the block's
scores.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring import device, ring_attention
from megatron_ring.kernels import math_kernel
from megatron_ring.kernels.dropout import DropoutKernel
from megatron_ring.transport.ring import LoopbackRing
from tests.fake_cuda.test_fake_cuda import Case, _inputs, _plan_on_host, fake_backward
from tests.helpers.fake_device import FakeCuda
from tests.helpers.seen_ops import LargestResult

pytestmark = pytest.mark.fake_cuda

MIB = 1 << 20


def largest(case: Case, rank: int = 1) -> tuple[LargestResult, int]:
    """One forward + backward of ``case`` on fake CUDA: the largest result, and the largest input or gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _plan_on_host(case, rank)
    with device.use("cuda", FakeCuda()), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, kw, leaves = _inputs(case)
        dout = torch.ones(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
        inputs = max(t.numel() * t.element_size() for t in (*leaves, dout))  # the gradients are shaped so too
        with LargestResult("cuda") as mode:
            out = ring_attention(q, k, v, ring=LoopbackRing(case.P, rank, q.device), **kw)
            fake_backward(out, dout, leaves)
    return mode, inputs


# 8 query heads, 2 K/V heads: a block's scores and its tiles scale with the heads, and the fake tier's time with the
# tiles (its cost is per op, not per element); 32 heads took 3-4 times as long and measured the same largest tensors
BIG = dict(kernel="auto", P=2, heads=(8, 2), dims=(128, 128), dtype=torch.float32)
CASES = {
    # a zigzag half block: 2 x 32 x 4K x 4K fp32 scores (4 GiB) in one tensor before tiles
    "fp32 causal, 8K tokens per rank": Case(**BIG, s_local=8192),
    "fp32 full, GQA, 8K tokens per rank": Case(**BIG, causal=False, s_local=8192),
    # masked tasks (document boundaries) fall back to the math kernel in fp32: runs of key tiles per query tile
    "fp32 packed documents, 16K tokens per rank": Case(**BIG, fmt="thd", s_local=16384),
    # the torch dropout kernel: fp32 scores and int64 keep hashes
    "fp32 dropout, 4K tokens per rank": Case(**BIG, dropout=0.1, s_local=4096),
}


@pytest.fixture(scope="module")
def sizes():
    got = {}
    for name, case in CASES.items():
        tiled, inputs = largest(case)
        with pytest.MonkeyPatch.context() as mp:  # the control: a budget of the whole block, one tile
            mp.setattr(math_kernel.MathKernel, "score_budget", 1 << 62)
            mp.setattr(DropoutKernel, "score_budget", 1 << 62)
            whole, _ = largest(case)
        got[name] = (tiled, whole, inputs)
    print("\n| case | largest tensor, tiles (MiB) | without tiles (MiB) | largest input (MiB) |\n|---|---|---|---|")
    for name, (tiled, whole, inputs) in got.items():
        print(f"| {name} | {tiled.bytes / MIB:.0f} | {whole.bytes / MIB:.0f} | {inputs / MIB:.0f} |")
        print("   tiles:", tiled.op, "\n   without:", whole.op)
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_no_tensor_over_the_score_budget(sizes, name):
    tiled, whole, inputs = sizes[name]
    limit = max(math_kernel.SCORE_BUDGET * 4, inputs)
    assert tiled.bytes <= limit, (tiled.bytes / MIB, limit / MIB, tiled.op)
    # the control: without tiles the measure sees scores over the budget, larger than anything with tiles
    assert whole.bytes > max(math_kernel.SCORE_BUDGET * 4, tiled.bytes), (whole.bytes / MIB, whole.op)
