"""``TEFusedKernel`` keeps nothing between a forward and its backward (one kernel object serves every layer):
its backward rebuilds TransformerEngine's ``aux_ctx_tensors`` (``F16_arbitrary_seqlen``, no dropout:
``[softmaxStats, rng_state]``) from the lse it is given.

TransformerEngine cannot be installed here (no GPU), so a stand-in module is injected as ``transformer_engine``:
float64 attention that records every call and, in the backward, checks that the stats it receives are the ones
its forward returned for the same q, k (and an int64 [2] rng state on q's device). Two layers' forwards run
before their backwards (interleaved, as in a model): each backward gets its own forward's stats and the
gradients equal :class:`MathKernel`'s float64 ones. Negative control: a backward given the other layer's lse
is caught by the stand-in.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_ring.kernels import block as K


class _StandInTE:
    """``transformer_engine.pytorch.cpp_extensions.fused_attn`` as the kernel calls it (BSHD, float64)."""

    FusedAttnBackend = {"F16_arbitrary_seqlen": "F16_arbitrary_seqlen"}

    def __init__(self) -> None:
        self.forwards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (q, k, stats returned)
        self.backward_aux: list[list[torch.Tensor]] = []

    @staticmethod
    def _attn(q, k, v, causal, scale):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), s.logsumexp(-1)

    def fused_attn_fwd(self, is_training, max_seqlen_q, max_seqlen_kv, cu_q, cu_kv, q, k, v, fake_dtype, backend,
                       attn_scale=None, dropout=0.0, qkv_layout=None, attn_mask_type=None, **_):
        assert is_training and dropout == 0.0 and qkv_layout == "bshd_bshd_bshd"
        out, lse = self._attn(q, k, v, attn_mask_type == "causal", attn_scale)
        stats = lse.float().unsqueeze(-1).contiguous()
        self.forwards.append((q.clone(), k.clone(), stats.clone()))
        rng_state = torch.tensor([len(self.forwards), 7], dtype=torch.int64, device=q.device)
        return out, [stats, rng_state]

    def fused_attn_bwd(self, max_seqlen_q, max_seqlen_kv, cu_q, cu_kv, q, k, v, o, d_o, fake_dtype, dqkv_dtype,
                       aux, backend, attn_scale=None, dropout=0.0, attn_mask_type=None, deterministic=False, **_):
        self.backward_aux.append(aux)
        mine = [stats for fq, fk, stats in self.forwards if torch.equal(fq, q) and torch.equal(fk, k)]
        assert len(mine) == 1 and torch.equal(aux[0], mine[0]), "the backward got another forward's stats"
        assert aux[1].shape == (2,) and aux[1].dtype == torch.int64 and aux[1].device == q.device
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out, _ = self._attn(q, k, v, attn_mask_type == "causal", attn_scale)
        return (*torch.autograd.grad(out, (q, k, v), d_o), None)


@pytest.fixture
def te(monkeypatch):
    fa = _StandInTE()
    modules = {name: types.ModuleType(name) for name in (
        "transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
        "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.cpp_extensions.fused_attn")}
    modules["transformer_engine.pytorch.constants"].TE_DType = {torch.float64: "TE:float64"}
    for name in ("fused_attn_fwd", "fused_attn_bwd", "FusedAttnBackend"):
        setattr(modules["transformer_engine.pytorch.cpp_extensions.fused_attn"], name, getattr(fa, name))
    modules["transformer_engine.pytorch.cpp_extensions"].fused_attn = \
        modules["transformer_engine.pytorch.cpp_extensions.fused_attn"]
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return fa


def _block(seed, b=2, h=4, h_kv=4, s=16, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, hh, s, d, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv)] + \
        [torch.randn(b, h, s, d, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("causal", [True, False])
def test_two_layers_interleaved_each_backward_gets_its_own_forward(te, causal):
    kern = K.TEFusedKernel()
    layers = [_block(1), _block(2)]
    fwd = [kern.forward(q, k, v, causal, 0.3) for q, k, v, _ in layers]  # both forwards, then both backwards
    for (q, k, v, dout), (out, lse) in zip(layers, fwd):
        got = kern.backward(dout, q, k, v, out, lse, causal, 0.3)
        x = [t.detach().requires_grad_() for t in (q, k, v)]  # float64 reference: torch's own SDPA
        ref = torch.nn.functional.scaled_dot_product_attention(*x, is_causal=causal, scale=0.3)
        want = torch.autograd.grad(ref, x, dout)
        tol = 64 * torch.finfo(torch.float64).eps  # float64 end to end: a few roundings of O(1) values
        torch.testing.assert_close(out, ref, rtol=0, atol=tol)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=tol)
    assert len(te.forwards) == 2 and len(te.backward_aux) == 2
    assert not any(k.startswith("_aux") for k in vars(kern))  # nothing kept on the object


def test_the_stand_in_catches_a_backward_given_another_forwards_stats(te):
    kern = K.TEFusedKernel()
    (qa, ka, va, da), (qb, kb, vb, _) = _block(1), _block(2)
    out_a, _ = kern.forward(qa, ka, va, False, 0.3)
    _, lse_b = kern.forward(qb, kb, vb, False, 0.3)
    with pytest.raises(AssertionError, match="another forward's stats"):
        kern.backward(da, qa, ka, va, out_a, lse_b, False, 0.3)
