"""GPU suite: every block kernel forward and backward vs float64 with the derived bound (the CPU kernels'
variants run in CI, the CUDA ones where a GPU is), named refusals for what a kernel does not take, the
side-stream seam with a delayed exchange, codecs on CUDA, and the GPU benchmark row. The engine on one
device is test_gpu_engine.py."""
import pytest
import torch

from megatron_ring.kernels import block as K
from megatron_ring.kernels.head_dim import HeadDimPadKernel
from megatron_ring.kernels.math_kernel import row_tiles
from tests.helpers.numerics import Checks, lse_tol, max_err, score_bound, tol
from tests.helpers.reference import block_reference
from megatron_ring.wire.codecs import make_codec, KVSpec
from megatron_ring.transport.streams import SideStream

CUDA_KERNELS = ["sdpa_cuda", "flash_attn", "flash_cuda", "cudnn", "te_fused"]
KERNEL_CASES = [("cpu", "flash_cpu"), ("cpu", "math")] + [("cuda", n) for n in CUDA_KERNELS]


def _kernel_or_named_refusal(name, q):
    """The kernel as ``kernel=name`` gives it, or skip/expect the named refusal (never a crash)."""
    if name in K.UNVERIFIED:
        with pytest.raises(ValueError, match="not verified on a GPU"):
            K.select_kernel(q, name)
        pytest.skip(f"{name} is refused by name until verified on a GPU")
    named = K.KERNELS[name]()
    # asked about the head dim its operands get (a head dim that is not a multiple of 8 is zero-padded to one on
    # the fused CUDA kernels, as select_kernel pads it): 60 runs padded to 64, not refused
    why = named.unsupported(q, K.operand_head_dim(named, q.shape[-1]))
    if why and "install" in why:
        pytest.skip(f"{name}: {why}")
    if why:
        with pytest.raises(ValueError, match=f"kernel {name!r} does not support"):
            K.select_kernel(q, name)
        return None
    return K.select_kernel(q, name)


def kernel_checks(device, name, dtype, head_dim, sq, sk, causal, heads, corrupt=False):
    g = torch.Generator().manual_seed(head_dim + sq)
    q = torch.randn(2, heads[0], sq, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(2, heads[1], sk, head_dim, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(2, heads[0], sq, head_dim, generator=g).to(device, dtype)
    kern = _kernel_or_named_refusal(name, q)
    if kern is None:
        return None
    if K.operand_head_dim(kern, head_dim) != head_dim:  # as a call runs it: operands zero-padded (kernels/head_dim.py)
        kern = HeadDimPadKernel(kern, K.operand_head_dim(kern, head_dim))
    scale = head_dim ** -0.5
    out, lse = kern.forward(q, k, v, causal, scale)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = block_reference(*leaves, causal, scale)
    ref_out.backward(dout.double())
    if corrupt:  # negative control: the backward told the wrong mask
        causal = not causal
    dq, dk, dv = kern.backward(dout, q, k, v, ref_out.detach().to(dtype), ref_lse.detach().float(), causal, scale)
    bound = dict(dtype=dtype, n=max(sq, sk, head_dim), sigma=score_bound(q.transpose(1, 2), k.transpose(1, 2)))
    checks = Checks(f"{name} {dtype} d={head_dim} {sq}x{sk} causal={causal} heads={heads}")
    checks.add("out", max_err(out, ref_out), tol(ref_out.abs().max().item(), **bound))
    checks.add("lse", max_err(lse, ref_lse), lse_tol(ref_lse, **bound))
    for what, got, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        checks.add(what, max_err(got, leaf.grad), tol(leaf.grad.abs().max().item(), **bound))
    return checks


BLOCKS = [(256, 256, True), (128, 256, True), (256, 128, True), (128, 256, False)]
# (device, name, dtype, head_dim, sq, sk, causal, heads): every CUDA kernel the full matrix (192: over the
# fused kernels' limit on some; 60: not a multiple of 8, zero-padded to 64 on the fused kernels), the CPU kernels a
# slice of it (the fast tier)
MATRIX = [(dev, n, dt, d, *blk, h) for dev, n in KERNEL_CASES for dt in (torch.float16, torch.bfloat16)
          for d in (64, 128, 192, 60) for blk in BLOCKS for h in ((8, 8), (8, 2))
          if dev == "cuda" or (dt == torch.bfloat16 and d in (64, 60) and h == (8, 2))]


@pytest.mark.parametrize("device, name, dtype, head_dim, sq, sk, causal, heads", MATRIX)
def test_kernel_forward_backward_vs_float64(device, name, dtype, head_dim, sq, sk, causal, heads):
    """Forward and backward of one block vs float64 (derived bound); a head dim or dtype the kernel does not
    take gives the named ValueError of ``kernel=name``."""
    checks = kernel_checks(device, name, dtype, head_dim, sq, sk, causal, heads)
    if checks is not None:
        checks.check(min_rows=5)


@pytest.mark.parametrize("device, name", KERNEL_CASES)
def test_kernel_negative_control_wrong_mask_is_over_the_bound(device, name):
    checks = kernel_checks(device, name, torch.bfloat16, 64, 256, 256, True, (8, 2), corrupt=True)
    assert checks is not None and checks.worst() > 10, checks and checks.rows


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_in_row_tiles_vs_float64(monkeypatch, device, causal):
    """fp32 on CUDA runs the math kernel; a block over its score budget runs in tiles of query rows
    (kernels/math_kernel.py ``row_tiles``): here 16 tiles of 16 rows, vs float64."""
    monkeypatch.setattr(K.MathKernel, "score_budget", 2 * 8 * 256 * 16)
    assert len(row_tiles(2, 8, 256, 256, causal, K.MathKernel.score_budget)) == 16
    checks = kernel_checks(device, "math", torch.float32, 64, 256, 256, causal, (8, 2))
    checks.check(min_rows=5)


def test_math_kernel_peak_memory_on_cuda():
    """A causal block whose fp32 scores are 8 GiB (32 heads, 8K x 8K, GQA 32/8) runs forward and backward on the
    math kernel with a peak of at most a quarter of that beyond its inputs (tiles of 256 MiB of scores)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 8192, 128, device="cuda", generator=g)
    k, v = (torch.randn(1, 8, 8192, 128, device="cuda", generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kern = K.MathKernel()
    out, lse = kern.forward(q, k, v, True, 128 ** -0.5)
    grads = kern.backward(dout, q, k, v, out, lse, True, 128 ** -0.5)
    torch.cuda.synchronize()
    peak, scores = torch.cuda.max_memory_allocated() - base, 32 * 8192 * 8192 * 4
    print(f"math kernel, 8K x 8K, 32 heads: peak {peak / 2**20:.0f} MiB beyond the inputs (scores {scores / 2**20:.0f} MiB)")
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert peak <= scores / 4, peak


def test_side_stream_overlaps_and_orders_a_delayed_exchange():
    side = SideStream(torch.device("cuda"))
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    with side.launch(src, dst):
        torch.cuda._sleep(50_000_000)  # a slow "exchange"
        dst.copy_(src)
    busy = torch.cuda.Event(enable_timing=True)
    busy.record()  # compute stream was not blocked by the side stream's sleep
    assert not side.stream.query()
    side.join()
    assert torch.equal(dst * 1, src)  # ordered after the join


@pytest.mark.parametrize("comm_dtype", ["bf16", "fp16", "fp8"])
def test_codecs_on_cuda(comm_dtype):
    k = torch.randn(2, 4, 64, 32, device="cuda")
    codec = make_codec(comm_dtype, torch.float32)
    spec = KVSpec(tuple(k.shape), tuple(k.shape), torch.float32, k.device)
    buf = codec.new_buffer(spec)
    codec.encode(k, k, buf)
    kd, vd = codec.decode(buf, spec)
    assert (kd - k).abs().max() <= {"bf16": 2e-2, "fp16": 2e-3, "fp8": 0.25}[comm_dtype] * k.abs().max()


def test_gpu_benchmark_row():
    from megatron_ring_lab.bench.gpu import gpu_row
    row = gpu_row(2, 2048, 8, 8, 64, torch.bfloat16, iters=3)
    print(row)
    assert row["efficiency"] > 0
