"""Ring attention vs an independent float64 full-sequence reference: outputs and dq/dk/dv.

For every P in {1, 2, 3, 4, 8}, one set of P gloo processes runs the whole matrix: all three layouts,
causal and not, MHA/GQA/MQA, head dims 64 and 80, fp32 and bf16, "bshd" and "sbhd", batch 2.

Tolerance: the derived bound of tests/helpers/numerics.py (docs/numerics.md, "Test tolerances"), the
reference fed the same dtype-rounded inputs. torch's one-process ``scaled_dot_product_attention`` in the
same dtype is held to the same bound (a check of the bound itself: it must cover torch's own kernel).
"""
import itertools

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import Checks, max_err, score_bound, tol
from megatron_ring import ring_attention, shard_sequence
from tests.helpers.reference import attention_reference, outputs_and_grads, sdpa

pytestmark = pytest.mark.slow  # every test here starts worker processes

HEADS = [(4, 4, 64, "bshd"), (4, 2, 80, "sbhd"), (6, 1, 80, "bshd")]  # (h, h_kv, d, format)


def _case_errors(world, layout, causal, heads, dtype, seed, **ring_kw):
    """Per tensor (out, dq, dk, dv): (name, max error of ring_attention(**ring_kw), same of 1-process SDPA,
    the derived bound); the float64 reference is fed the dtype-rounded inputs."""
    h, h_kv, d, fmt = heads
    b, s_local = 2, 6
    seq = s_local * world
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, seq, h, d, generator=g).to(dtype).float() for _ in range(2))
    k, v = (torch.randn(b, seq, h_kv, d, generator=g).to(dtype).float() for _ in range(2))
    sigma = score_bound(q, k)
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
        errors.append((name, max_err(r, f_local), max_err(b_local, f_local),
                       tol(f.abs().max().item(), dtype=dtype, n=max(seq, d), sigma=sigma, blocks=2 * world)))
    return errors


def _matrix_worker(rank, world):
    results = []
    cases = itertools.product(("contiguous", "zigzag", "striped"), (False, True), HEADS,
                              (torch.float32, torch.bfloat16))
    for i, (layout, causal, heads, dtype) in enumerate(cases):
        for name, ring_err, sdpa_err, bound in _case_errors(world, layout, causal, heads, dtype, seed=100 + i):
            label = (layout, causal, heads, str(dtype), name)
            results += [(label + ("ring",), ring_err, bound), (label + ("sdpa",), sdpa_err, bound)]
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_matches_full_attention(world):
    checks = Checks(f"ring_attention P={world}")
    for rows in run_distributed(_matrix_worker, world, timeout=420):
        checks.extend(rows)
    checks.check(min_rows=3 * 2 * len(HEADS) * 2 * 4 * 2 * world)


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
        sigma = score_bound(q, k)
        for what, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
            errs.append(((layout, causal, chunks, h, h_kv, what), max_err(a, shard_sequence(r, 1, layout=layout)),
                         tol(r.abs().max().item(), dtype=torch.float32, n=max(seq, d), sigma=sigma)))
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_head_chunks_are_exact(world):
    """Running the ring over groups of K/V heads in turn gives the same outputs and gradients (fp32)."""
    checks = Checks(f"head_chunks P={world}")
    for rows in run_distributed(_head_chunks_worker, world, timeout=300):
        checks.extend(rows)
    checks.check(min_rows=3 * 2 * 3 * 2 * 4 * world)
