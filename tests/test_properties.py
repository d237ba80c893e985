"""Property-based checks (hypothesis; bounded, derandomised = seeded, no deadline) of the whole engine,
each rank's ring in its own thread (tests/helpers/ring_fakes.ThreadRing), against the float64 reference:
P, lengths, heads (GQA), head dims, layouts, causal, dtypes and wire dtypes; plus adversarial inputs
(|scores| up to 1e4, all-equal scores, NaN in one rank's K with a checking wire)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.numerics import grad_terms, max_err, rel_tol, score_bound
from tests.helpers.reference import attention_reference
from tests.helpers.ring_fakes import run_threads
from megatron_ring import ring_attention
from megatron_ring.errors import WireFiniteError
from megatron_ring.schedules.layouts import get_layout

SETTINGS = dict(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                print_blob=True)
# (compute dtype, wire dtype) pairs; tolerance vs float64: the derived bound of tests/helpers/numerics.py
DTYPE_WIRES = [("float32", None), ("float32", "bf16"), ("float32", "fp8"), ("bfloat16", None), ("bfloat16", "fp8")]


def _ring_run(q, k, v, world, layout, causal, comm_dtype, grads=True):
    """Shard the full [b, S, h, d] tensors with the layout, run every rank, gather out (and grads)."""
    lay = get_layout(layout)
    S = q.shape[1]
    pos = [lay.positions(S, world, r) for r in range(world)]
    g = torch.Generator().manual_seed(S)  # seeded: hypothesis replays an example with the same dout
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64).to(q.dtype).double()  # the reference sees it rounded

    def rank(r, ring):
        leaves = [t[:, pos[r]].detach().clone().requires_grad_(grads) for t in (q, k, v)]
        out = ring_attention(*leaves, causal=causal, layout=layout, comm_dtype=comm_dtype, ring=ring)
        if grads:
            out.backward(dout[:, pos[r]].to(out.dtype))
            return out.detach(), *[t.grad for t in leaves]
        return (out.detach(),)

    res = run_threads(rank, world)
    for r in res:
        if isinstance(r, BaseException):
            raise r
    full = []
    for i in range(len(res[0])):
        x = torch.empty((q.shape[0], S) + res[0][i].shape[2:], dtype=res[0][i].dtype)
        for r in range(world):
            x[:, pos[r]] = res[r][i]
        full.append(x)
    return full, dout


def _reference(q, k, v, causal, dout):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, causal)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@settings(**SETTINGS)
@given(world=st.sampled_from([1, 2, 3, 4]), chunks=st.integers(1, 3), heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
       head_dim=st.sampled_from([8, 16, 24]), layout=st.sampled_from(["zigzag", "striped", "contiguous"]),
       causal=st.booleans(), dtype_wire=st.sampled_from(sorted(DTYPE_WIRES, key=str)), seed=st.integers(0, 2**16))
def test_ring_matches_float64_reference(world, chunks, heads, head_dim, layout, causal, dtype_wire, seed):
    dtype_name, wire = dtype_wire
    dtype = getattr(torch, dtype_name)
    S = world * get_layout(layout).local_multiple() * chunks
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, heads[0], head_dim, generator=g).to(dtype)
    k = torch.randn(1, S, heads[1], head_dim, generator=g).to(dtype)
    v = torch.randn(1, S, heads[1], head_dim, generator=g).to(dtype)
    got, dout = _ring_run(q, k, v, world, layout, causal, wire)
    want = _reference(q, k, v, causal, dout)
    rel = rel_tol(dtype=dtype, n=max(S, head_dim), sigma=score_bound(q, k), wire=wire, blocks=2 * world)
    terms = grad_terms(q, k, v, dout, n=S)  # S = 1: one visible key, dq and dk cancel to 0 (helpers.numerics)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err, m = max_err(a, b), b.abs().max().item()
        if name in ("dq", "dk") and S == 1:
            m = max(m, terms)
        assert err <= rel * m, (name, err, rel * m)


@settings(**dict(SETTINGS, max_examples=6))
@given(world=st.sampled_from([2, 4]), magnitude=st.sampled_from([1e2, 1e3, 1e4]), seed=st.integers(0, 2**16))
def test_huge_scores_do_not_overflow(world, magnitude, seed):
    """|scores| up to 1e4 (one-hot-like softmax rows): finite and equal to the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    S, d = 4 * world, 16
    q = torch.randn(1, S, 2, d, generator=g)
    q = q / q.norm(dim=-1, keepdim=True) * math.sqrt(magnitude * math.sqrt(d))
    k = q.clone()  # q.k up to magnitude * sqrt(d), scaled by 1/sqrt(d): scores up to `magnitude`
    v = torch.randn(1, S, 2, d, generator=g)
    got, dout = _ring_run(q, k, v, world, "zigzag", True, None, grads=False)
    want = _reference(q, k, v, True, dout)
    assert torch.isfinite(got[0]).all()
    rel = rel_tol(dtype=torch.float32, n=max(S, d), sigma=score_bound(q, k))
    assert max_err(got[0], want[0]) <= rel * want[0].abs().max().item()


@pytest.mark.parametrize("world", [2, 3])
def test_all_equal_scores_average_the_visible_values(world):
    S = 4 * world
    q = torch.zeros(1, S, 2, 8)
    v = torch.randn(1, S, 2, 8)
    got, dout = _ring_run(q, q.clone(), v, world, "striped", True, None)
    want = _reference(q, q.clone(), v, True, dout)
    rel = rel_tol(dtype=torch.float32, n=max(S, 8), sigma=0.0)  # every score is 0
    for a, b in zip(got, want):
        assert max_err(a, b) <= rel * b.abs().max().item()


@pytest.mark.parametrize("world, bad", [(3, 1), (4, 3)])
def test_nan_in_one_rank_is_reported_on_every_rank(world, bad):
    """NaN in one rank's K with a checking (fp8) wire: every rank raises, none hangs, none returns NaN."""
    S = 2 * world

    def rank(r, ring):
        k = torch.randn(1, S // world * 1, 2, 8)
        if r == bad:
            k[0, 0, 0, 0] = float("nan")
        try:
            ring_attention(torch.randn_like(k), k, torch.randn_like(k), causal=True, layout="striped",
                           comm_dtype="fp8", ring=ring)
        except WireFiniteError as exc:
            return str(exc)
        return "returned"

    res = run_threads(rank, world)
    assert all(isinstance(x, str) and x != "returned" for x in res), res
    assert all(f"global rank(s) {bad}" in x for r, x in enumerate(res) if r != bad), res
