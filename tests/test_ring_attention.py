"""Ring attention vs an independent float64 full-sequence reference: outputs and dq/dk/dv.

For every P in {1, 2, 3, 4, 8}, one set of P gloo processes runs the whole matrix: all three layouts,
causal and not, MHA/GQA/MQA, head dims 64 and 80, fp32 and bf16, "bshd" and "sbhd", batch 2.

Tolerance (per dtype): the ring's max abs error against float64 must be at most ``FACTOR`` times the
error of torch's one-process ``scaled_dot_product_attention`` in the same dtype, plus a floor
(``FLOOR[dtype]``) for cases where SDPA happens to be nearly exact.
"""
import itertools

import pytest
import torch

from dist_utils import run_distributed
from megatron_ring import ring_attention, shard_sequence
from reference import attention_reference, outputs_and_grads, sdpa

FACTOR = 4.0
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 4e-3}
HEADS = [(4, 4, 64, "bshd"), (4, 2, 80, "sbhd"), (6, 1, 80, "bshd")]  # (h, h_kv, d, format)


def _case_errors(world, layout, causal, heads, dtype, seed, **ring_kw):
    """Per tensor (out, dq, dk, dv): (name, max error of ring_attention(**ring_kw), same of 1-process SDPA)."""
    h, h_kv, d, fmt = heads
    b, s_local = 2, 6
    seq = s_local * world
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, seq, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, seq, h_kv, d, generator=g) for _ in range(2))
    ref = outputs_and_grads(lambda *t: attention_reference(*t, causal), q.double(), k.double(), v.double(),
                            dout.double())
    base = outputs_and_grads(lambda *t: sdpa(*t, causal), q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype))
    sdim = 1 if fmt == "bshd" else 0
    to_fmt = (lambda t: t) if fmt == "bshd" else (lambda t: t.transpose(0, 1).contiguous())
    local = [to_fmt(shard_sequence(t, 1, layout=layout)).to(dtype) for t in (q, k, v, dout)]

    def run(qq, kk, vv):
        out = ring_attention(qq, kk, vv, causal=causal, layout=layout, qkv_format=fmt, **ring_kw)
        assert out.shape == qq.shape and out.dtype == dtype and out.is_contiguous()
        return out

    ring = outputs_and_grads(run, *local)
    errors = []
    for name, r, bse, f in zip(("out", "dq", "dk", "dv"), ring, base, ref):
        f_local = to_fmt(shard_sequence(f, 1, layout=layout))
        b_local = to_fmt(shard_sequence(bse, 1, layout=layout))
        errors.append((name, (r.double() - f_local).abs().max().item(),
                       (b_local.double() - f_local).abs().max().item()))
    return errors


def _matrix_worker(rank, world):
    results = []
    cases = itertools.product(("contiguous", "zigzag", "striped"), (False, True), HEADS,
                              (torch.float32, torch.bfloat16))
    for i, (layout, causal, heads, dtype) in enumerate(cases):
        for name, ring_err, sdpa_err in _case_errors(world, layout, causal, heads, dtype, seed=100 + i):
            results.append((layout, causal, heads, str(dtype), name, ring_err, sdpa_err))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_matches_full_attention(world):
    per_rank = run_distributed(_matrix_worker, world, timeout=420)
    failures = []
    for rows in per_rank:
        for layout, causal, heads, dtype, name, ring_err, sdpa_err in rows:
            bound = FACTOR * sdpa_err + FLOOR[getattr(torch, dtype.split(".")[1])]
            if not ring_err <= bound:
                failures.append(f"{layout} causal={causal} heads={heads} {dtype} {name}: "
                                f"ring {ring_err:.3g} > bound {bound:.3g} (sdpa {sdpa_err:.3g})")
    assert not failures, "\n".join(failures[:20])


def _head_chunks_worker(rank, world):
    errs = []
    for layout, causal, chunks, (h, h_kv) in itertools.product(("zigzag", "striped", "contiguous"), (False, True),
                                                               (2, 3, 8), ((6, 3), (8, 4))):
        g = torch.Generator().manual_seed(7)
        b, seq, d = 2, 8 * world, 16
        q, dout = (torch.randn(b, seq, h, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, seq, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2))
        ref = outputs_and_grads(lambda *t: attention_reference(*t, causal), q, k, v, dout)
        local = [shard_sequence(t, 1, layout=layout).float() for t in (q, k, v, dout)]
        got = outputs_and_grads(lambda *t: ring_attention(*t, causal=causal, layout=layout, head_chunks=chunks),
                                *local)
        errs.append(max((a.double() - shard_sequence(r, 1, layout=layout)).abs().max().item()
                        for a, r in zip(got, ref)))
    return max(errs)


@pytest.mark.parametrize("world", [2, 3])
def test_head_chunks_are_exact(world):
    """Running the ring over groups of K/V heads in turn gives the same outputs and gradients (fp32)."""
    assert max(run_distributed(_head_chunks_worker, world, timeout=300)) < 5e-6
