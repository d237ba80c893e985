"""The CPU opt-in's pure-torch Mamba-2 / Gated-DeltaNet kernels vs token-by-token float64 recurrences.

The references below are the definitions written as loops over time (one token at a time, float64);
the kernels compute in chunks. float64 inputs: outputs and gradients agree to float64 rounding
(tolerance ``64 * eps64 * sqrt(terms)`` relative to the largest magnitude); float32 inputs: the kernels
compute in float32, so ``64 * eps32 * sqrt(terms)``. Every case with documents also checks that the
restart matters (the same input as one document differs), so a kernel that ignored ``seq_idx`` /
``cu_seqlens`` would fail.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ring_lab.cpu import ssm_kernels as K

EPS = {torch.float64: torch.finfo(torch.float64).eps, torch.float32: torch.finfo(torch.float32).eps}


def _tol(dtype: torch.dtype, terms: int, ref: torch.Tensor) -> float:
    """A gradient is compared in its leaf's dtype (Megatron keeps A_log, D, dt_bias in float32)."""
    return 64 * EPS[dtype] * math.sqrt(terms) * max(1.0, float(ref.detach().abs().max()))


def _seq_idx(b: int, lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)]).expand(b, -1).contiguous()


# --------------------------------------------------------------------------------------------------
# float64 token-by-token references
# --------------------------------------------------------------------------------------------------
def ref_conv(x, w, bias, seq_idx, act):
    b, d, l = x.shape
    width = w.shape[1]
    out = torch.zeros(b, d, l, dtype=torch.float64)
    for t in range(l):
        acc = bias.double().expand(b, d).clone() if bias is not None else torch.zeros(b, d, dtype=torch.float64)
        for k in range(width):
            src = t - (width - 1) + k
            if src < 0:
                continue
            term = x[:, :, src].double() * w[:, k].double()
            if seq_idx is not None:
                term = term * (seq_idx[:, src] == seq_idx[:, t]).double()[:, None]
            acc = acc + term
        out[:, :, t] = acc
    return F.silu(out) if act == "silu" else out


def ref_ssd(x, dt, A, B, C, D, z, dt_bias, seq_idx):
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    dtv = F.softplus(dt.double() + dt_bias.double())
    Bh = B.double().repeat_interleave(h // g, dim=2)
    Ch = C.double().repeat_interleave(h // g, dim=2)
    state = torch.zeros(b, h, p, n, dtype=torch.float64)
    ys = []
    for t in range(l):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).double()[:, None, None, None]
            state = state * keep
        decay = torch.exp(dtv[:, t] * A.double())  # [b, h]
        state = decay[..., None, None] * state + (dtv[:, t, :, None] * x[:, t].double())[..., None] * Bh[:, t, :, None, :]
        y = (state * Ch[:, t, :, None, :]).sum(-1) + D.double()[None, :, None] * x[:, t].double()
        ys.append(y)
    y = torch.stack(ys, dim=1)
    return y * F.silu(z.double()) if z is not None else y


def ref_gdn(q, k, v, g, beta, scale, cu_seqlens):
    bsz, t_len, h, dk = k.shape
    dv = v.shape[-1]
    starts = set(cu_seqlens.tolist()[:-1]) if cu_seqlens is not None else {0}
    S = torch.zeros(bsz, h, dk, dv, dtype=torch.float64)
    out = []
    for t in range(t_len):
        if t in starts:
            S = torch.zeros_like(S)
        S = S * torch.exp(g[:, t].double())[..., None, None]
        kt, vt, qt = k[:, t].double(), v[:, t].double(), q[:, t].double() * scale
        u = beta[:, t].double()[..., None] * (vt - (S * kt[..., None]).sum(-2))
        S = S + kt[..., None] * u[..., None, :]
        out.append((S * qt[..., None]).sum(-2))
    return torch.stack(out, dim=1)


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("docs", [None, [5, 1, 7, 3]])
def test_causal_conv1d_vs_reference(dtype, docs):
    torch.manual_seed(0)
    b, d, l, width = 2, 6, 16, 4
    x = torch.randn(b, d, l, dtype=dtype, requires_grad=True)
    w = torch.randn(d, width, dtype=dtype, requires_grad=True)
    bias = torch.randn(d, dtype=dtype, requires_grad=True)
    seq = _seq_idx(b, docs) if docs else None
    out = K.causal_conv1d_fn(x, w, bias, seq_idx=seq, activation="silu")
    ref = ref_conv(x, w, bias, seq, "silu")
    assert out.dtype == dtype
    tol = _tol(dtype, width, ref)
    assert (out.double() - ref).abs().max() <= tol
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (x, w, bias), go.to(dtype))
    grads_ref = torch.autograd.grad(ref, (x, w, bias), go)
    for a, r in zip(grads, grads_ref):
        assert (a.double() - r).abs().max() <= _tol(a.dtype, width * b * l, r)
    if docs:  # the restart matters
        assert (ref_conv(x, w, bias, None, "silu") - ref).abs().max() > 1e3 * tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("docs", [None, [6, 1, 9, 4]])
def test_ssd_scan_vs_recurrence(dtype, chunk, docs):
    torch.manual_seed(1)
    b, l, h, p, g, n = 2, 20, 4, 3, 2, 5
    x = torch.randn(b, l, h, p, dtype=dtype, requires_grad=True)
    dt = torch.randn(b, l, h, dtype=dtype, requires_grad=True)
    A = (-torch.rand(h, dtype=torch.float32) * 2 - 0.2).requires_grad_()
    B = torch.randn(b, l, g, n, dtype=dtype, requires_grad=True)
    C = torch.randn(b, l, g, n, dtype=dtype, requires_grad=True)
    D = torch.randn(h, dtype=torch.float32, requires_grad=True)
    z = torch.randn(b, l, h, p, dtype=dtype, requires_grad=True)
    dt_bias = torch.randn(h, dtype=torch.float32, requires_grad=True)
    seq = _seq_idx(b, docs) if docs else None
    y = K.ssd_chunk_scan(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq)
    ref = ref_ssd(x, dt, A, B, C, D, z, dt_bias, seq)
    assert y.dtype == dtype and y.shape == ref.shape
    assert (y.double() - ref).abs().max() <= _tol(dtype, l * n, ref)
    leaves = (x, dt, A, B, C, D, z, dt_bias)
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(y, leaves, go.to(dtype))
    grads_ref = torch.autograd.grad(ref, leaves, go)
    for a, r in zip(grads, grads_ref):
        assert torch.isfinite(a).all()
        assert (a.double() - r).abs().max() <= _tol(a.dtype, b * l * l * n, r)
    if docs:
        assert (ref_ssd(x, dt, A, B, C, D, z, dt_bias, None) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("docs", [None, [7, 2, 11]])
def test_split_conv1d_scan_combined_vs_reference(docs):
    torch.manual_seed(2)
    b, l, h, p, g, n, width = 1, 20, 4, 2, 2, 3, 4
    dim = h * p
    zxbcdt = torch.randn(b, l, 2 * dim + 2 * g * n + h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(dim + 2 * g * n, width, dtype=torch.float64)
    cb = torch.randn(dim + 2 * g * n, dtype=torch.float64)
    dt_bias, A, D = torch.randn(h, dtype=torch.float64), -torch.rand(h, dtype=torch.float64) - 0.1, torch.randn(h, dtype=torch.float64)
    seq = _seq_idx(b, docs) if docs else None
    y = K.mamba_split_conv1d_scan_combined(zxbcdt, w, cb, dt_bias, A, D, chunk_size=8, seq_idx=seq,
                                           activation="silu", headdim=p, ngroups=g, norm_before_gate=False)
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * g * n, h], dim=-1)
    xBC = ref_conv(xBC.transpose(1, 2), w, cb, seq, "silu").transpose(1, 2)
    x, Bm, Cm = torch.split(xBC, [dim, g * n, g * n], dim=-1)
    ref = ref_ssd(x.reshape(b, l, h, p), dt, A, Bm.reshape(b, l, g, n), Cm.reshape(b, l, g, n), D,
                  z.reshape(b, l, h, p), dt_bias, seq).reshape(b, l, dim)
    assert (y - ref).abs().max() <= _tol(torch.float64, l * n, ref)
    go = torch.randn_like(ref)
    (ga,), (gr,) = torch.autograd.grad(y, zxbcdt, go), torch.autograd.grad(ref, zxbcdt, go)
    assert (ga - gr).abs().max() <= _tol(torch.float64, l * l * n, gr)


def test_rms_norm_gated():
    torch.manual_seed(3)
    x, zg = torch.randn(3, 5, 12, dtype=torch.float64), torch.randn(3, 5, 12, dtype=torch.float64)
    norm = K.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, dtype=torch.float64))
    gated = x * F.silu(zg)
    grp = gated.reshape(3, 5, 3, 4)
    ref = (grp / torch.sqrt(grp.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 5, 12) * norm.weight
    assert (norm(x, zg) - ref).abs().max() <= _tol(torch.float64, 4, ref)
    plain = x.reshape(3, 5, 3, 4)
    ref_plain = (plain / torch.sqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 5, 12) * norm.weight
    assert (norm(x) - ref_plain).abs().max() <= _tol(torch.float64, 4, ref_plain)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("docs", [None, [6, 1, 10, 5]])
def test_gated_delta_rule_vs_recurrence(dtype, chunk, docs):
    torch.manual_seed(4)
    bsz, t_len, h, dk, dv = (1 if docs else 2), 22, 3, 4, 5
    q = K.l2norm(torch.randn(bsz, t_len, h, dk, dtype=dtype)).requires_grad_()
    k = K.l2norm(torch.randn(bsz, t_len, h, dk, dtype=dtype)).requires_grad_()
    v = torch.randn(bsz, t_len, h, dv, dtype=dtype, requires_grad=True)
    g = (-F.softplus(torch.randn(bsz, t_len, h, dtype=torch.float32))).requires_grad_()
    beta = torch.rand(bsz, t_len, h, dtype=dtype).requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32) if docs else None
    o, _ = K.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, chunk_size=chunk)
    ref = ref_gdn(q, k, v, g, beta, dk ** -0.5, cu)
    assert o.dtype == dtype
    assert (o.double() - ref).abs().max() <= _tol(dtype, t_len * dk, ref)
    leaves = (q, k, v, g, beta)
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(o, leaves, go.to(dtype))
    grads_ref = torch.autograd.grad(ref, leaves, go)
    for a, r in zip(grads, grads_ref):
        assert torch.isfinite(a).all()
        assert (a.double() - r).abs().max() <= _tol(a.dtype, t_len * t_len * dk, r)
    if docs:
        assert (ref_gdn(q, k, v, g, beta, dk ** -0.5, None) - ref).abs().max() > 1e-3


def test_fla_conv_and_l2norm():
    torch.manual_seed(5)
    x = torch.randn(1, 12, 6, dtype=torch.float64)
    w, bias = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12])
    y, state = K.fla_causal_conv1d(x, w, bias, activation="silu", cu_seqlens=cu)
    ref = ref_conv(x.transpose(1, 2), w, bias, _seq_idx(1, [5, 7]), "silu").transpose(1, 2)
    assert state is None and (y - ref).abs().max() <= _tol(torch.float64, 4, ref)
    xn = K.l2norm(x)
    ref_n = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    assert (xn - ref_n).abs().max() <= _tol(torch.float64, 6, ref_n)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="cu_seqlens"):
        K.seq_idx_from_cu_seqlens(torch.tensor([0, 3, 9]), 10)
    with pytest.raises(NotImplementedError, match="conv states"):
        K.causal_conv1d_fn(torch.randn(1, 2, 3), torch.randn(2, 2), return_final_states=True)
    with pytest.raises(ValueError, match="value heads"):
        K.chunk_gated_delta_rule(torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 3), torch.randn(1, 4, 4, 3),
                                 g=torch.zeros(1, 4, 2), beta=torch.ones(1, 4, 2))


def test_cpu_opt_in_binds_the_kernels_and_restores_megatron():
    """Inside megatron_cpu() Megatron's Mamba / GDN kernel names are the pure-torch ones (only where the
    packages are missing); on exit every original is back."""
    mixer = pytest.importorskip("megatron.core.ssm.mamba_mixer", exc_type=ImportError)
    from megatron_ring_lab.cpu import megatron_cpu
    from megatron_ring_lab.cpu import ssm

    planned = ssm.planned()
    absent = object()  # a kernel name this megatron-core leaves unbound without mamba_ssm: removed again on exit
    before = [(obj, attr, getattr(obj, attr, absent)) for obj, attr, _ in planned]
    if not mixer.HAVE_MAMBA_SSM:
        assert any(attr == "mamba_split_conv1d_scan_combined" for _, attr, _ in planned)
    with megatron_cpu():
        for obj, attr, new in planned:
            assert getattr(obj, attr) is new or attr in ("__init__", "forward", "reset_parameters"), (obj, attr)
        if not before or mixer.mamba_split_conv1d_scan_combined is not None:
            assert mixer.HAVE_MAMBA_SSM
    for obj, attr, old in before:
        assert getattr(obj, attr, absent) is old, (obj, attr)
