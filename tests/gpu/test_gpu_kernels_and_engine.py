"""GPU suite (run on a GPU; skipped on CPU): every CUDA kernel vs float64, the engine on one GPU through
ThreadRing ranks (each rank a thread on the one GPU), the side-stream seam with a delayed exchange, codecs on CUDA, and
the GPU benchmark row. Written without a GPU (none was available): expect to adjust tolerances on the
first real run, never the contract."""
import pytest
import torch

from megatron_ring.kernels import block as K
from megatron_ring import ring_attention
from megatron_ring.wire.codecs import make_codec, KVSpec
from megatron_ring.transport.streams import SideStream

CUDA_KERNELS = ["sdpa_cuda", "flash_attn", "flash_cuda", "cudnn", "te_fused"]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


def _ref(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double().repeat_interleave(g, 1), torch.logsumexp(s, -1)


@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("sq, sk, causal", [(256, 256, True), (128, 256, True), (256, 128, True), (128, 256, False)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_cuda_kernel_vs_float64(name, dtype, head_dim, sq, sk, causal, heads):
    kern = K.KERNELS[name]()
    q = torch.randn(2, heads[0], sq, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, heads[1], sk, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(2, heads[1], sk, head_dim, device="cuda", dtype=dtype)
    if not kern.supports(q, k):
        pytest.skip(f"{name} does not support {dtype} d={head_dim} on this GPU (auto falls back)")
    scale = head_dim ** -0.5
    out, lse = kern.forward(q, k, v, causal, scale)
    ref_out, ref_lse = _ref(q, k, v, causal, scale)
    assert (out.double() - ref_out).abs().max() <= TOL[dtype] * 4
    assert (lse.double() - ref_lse).abs().max() <= 1e-2
    dout = torch.randn_like(out)
    dq, dk, dv = kern.backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), causal, scale)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = _ref(*leaves, causal, scale)
    o.backward(dout.double())
    for got, want in zip((dq, dk, dv), (t.grad for t in leaves)):
        assert (got.double() - want).abs().max() <= TOL[dtype] * 16 * max(1.0, want.abs().max().item())


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
