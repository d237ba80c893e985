"""Bad input fails with a ValueError naming the fix; mismatches across ranks fail on every rank."""
import pytest
import torch

from tests.helpers.numerics import max_err, score_bound, tol

import megatron_ring.core.validation as validation
from tests.helpers.launch import run_distributed
from megatron_ring import ring_attention


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("q,k,v,kwargs,match", [
    (t(1, 8, 4, 16), t(1, 8, 3, 16), t(1, 8, 3, 16), {}, "multiple of key/value heads"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16, dtype=torch.bfloat16), t(1, 8, 2, 16), {}, "share one dtype"),
    (t(1, 8, 4, 16), t(1, 8, 2, 32), t(1, 8, 2, 32), {}, "same head dim"),
    (t(1, 8, 4, 16), t(1, 6, 2, 16), t(1, 6, 2, 16), {}, "same batch and local sequence"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), {"layout": "diagonal"}, "unknown layout"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), {"qkv_format": "bhsd"}, "unknown qkv_format"),
    (t(1, 7, 4, 16), t(1, 7, 2, 16), t(1, 7, 2, 16), {"layout": "zigzag"}, "multiple of 2"),
    (t(8, 4, 16), t(8, 2, 16), t(8, 2, 16), {}, "4-D tensor"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), {"softmax_scale": -1.0}, "positive finite"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), {"kernel": "nope"}, "unknown kernel"),
    (t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), {"comm_dtype": torch.int8}, "comm_dtype"),
])
def test_bad_input_single_process(q, k, v, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ring_attention(q, k, v, **kwargs)


def test_odd_length_is_fine_for_striped_and_contiguous():
    q, k, v = t(1, 7, 2, 8), t(1, 7, 2, 8), t(1, 7, 2, 8)
    for layout in ("striped", "contiguous"):
        assert ring_attention(q, k, v, causal=True, layout=layout).shape == q.shape


def _mismatch_worker(rank, world, what):
    s = 8
    dtype = torch.float32
    causal = True
    if what == "seq" and rank == world - 1:
        s = 10
    if what == "dtype" and rank == 0:
        dtype = torch.bfloat16
    if what == "causal" and rank == 1:
        causal = False
    if what == "bad_len_one_rank" and rank == 1:
        s = 7  # invalid for zigzag on this rank only: still reported on every rank, no hang
    chunks = 2 if what == "head_chunks" and rank == 2 else 1
    q = torch.randn(1, s, 2, 8, dtype=dtype)
    try:
        ring_attention(q, q, q, causal=causal, layout="zigzag", head_chunks=chunks)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("what,needle", [("seq", "q.shape[1]"), ("dtype", "q.dtype"), ("causal", "causal"),
                                         ("bad_len_one_rank", "q.shape[1]"), ("head_chunks", "head_chunks")])
def test_mismatch_across_ranks_raises_everywhere(what, needle):
    msgs = run_distributed(_mismatch_worker, 3, what, timeout=120)
    assert all(m is not None and "different arguments" in m and needle in m for m in msgs), msgs


def _cached_check_worker(rank, world):
    calls = []
    real = validation.dist.all_gather

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    validation.dist.all_gather = counting
    q = torch.randn(1, 8, 2, 8)
    for _ in range(3):
        ring_attention(q, q, q, causal=True)
    ring_attention(q[:, :4], q[:, :4], q[:, :4], causal=True)  # new signature: checked once more
    ring_attention(q, q, q, causal=True, check_consistency=False)
    return len(calls)


@pytest.mark.slow
def test_consistency_check_runs_once_per_signature():
    assert run_distributed(_cached_check_worker, 2, timeout=120) == [2, 2]


def _wire_spelling_worker(rank, world):
    q = torch.randn(1, 8, 2, 8)
    spelling = "fp8" if rank == 0 else torch.float8_e4m3fn
    return ring_attention(q, q, q, causal=True, comm_dtype=spelling).shape == q.shape


@pytest.mark.slow
def test_wire_dtype_spellings_agree_across_ranks():
    assert all(run_distributed(_wire_spelling_worker, 2, timeout=120))


@pytest.mark.parametrize("head_chunks", [1, 2])
def test_non_dense_views_in_contiguous_out(head_chunks):
    """q/k/v sliced out of one fused projection (non-dense views) work; the output is contiguous."""
    torch.manual_seed(0)
    fused = torch.randn(10, 2, 2, 3 * 8, requires_grad=True)  # [s, b, h_kv, (q, k, v) * d] like Megatron's QKV
    q, k, v = fused.split(8, dim=-1)
    out = ring_attention(q, k, v, causal=True, qkv_format="sbhd", layout="striped", head_chunks=head_chunks)
    assert out.is_contiguous() and out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                           is_causal=True).permute(2, 0, 1, 3)
    # two fp32 computations of the same attention: within twice the derived bound of each other
    kw = dict(dtype=torch.float32, n=10, sigma=score_bound(q, k), runs=2)
    assert max_err(out, ref) <= tol(ref.abs().max().item(), **kw)
    (g_ring,) = torch.autograd.grad(out.sum(), fused)
    (g_ref,) = torch.autograd.grad(ref.sum(), fused)
    assert max_err(g_ring, g_ref) <= tol(g_ref.abs().max().item(), **kw)


@pytest.mark.parametrize("bad", ["layer 3", 2.0, True])
def test_a_call_id_that_is_not_an_int_is_refused(bad):
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="call_id must be an int"):
        ring_attention(q, q, q, call_id=bad)
