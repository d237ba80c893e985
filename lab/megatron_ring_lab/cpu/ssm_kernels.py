"""Pure-torch kernels for Megatron's Mamba-2 and Gated-DeltaNet layers, for the CPU opt-in only.

Megatron's ``MambaMixer`` and ``GatedDeltaNet`` call CUDA / Triton kernels (``mamba_ssm``,
``causal_conv1d``, flash-linear-attention). :mod:`.ssm` switches these functions in for them while the CPU
opt-in is active; nothing else uses them. They compute the same math, in float32 (float64 inputs stay
float64), with autograd doing the backward:

* :func:`causal_conv1d_fn`: depthwise causal convolution over time, ``[b, d, l]``, optional SiLU, optional
  ``seq_idx`` (packed documents: a token never sees a token of another document).
* :func:`ssd_chunk_scan`: the Mamba-2 selective state-space scan (SSD) in chunks: within a chunk the
  quadratic (attention-like) form, across chunks the state passed on. Per head ``h`` with
  ``dt' = softplus(dt + dt_bias)``: ``H_t = exp(dt'_t A_h) H_{t-1} + dt'_t x_t B_t^T``,
  ``y_t = H_t C_t + D_h x_t``; ``y *= silu(z)`` when ``z`` is given. ``seq_idx`` restarts the state.
* :func:`mamba_split_conv1d_scan_combined` / :func:`mamba_chunk_scan_combined`: ``mamba_ssm``'s two entry
  points that Megatron's mixer calls, built from the two above.
* :class:`RMSNormGated`: ``mamba_ssm``'s gated group RMSNorm module (``norm(x * silu(z))``).
* :func:`chunk_gated_delta_rule`: the gated delta rule in chunks (``S_t = (I - b_t k_t k_t^T) e^{g_t}
  S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t * scale``); within a chunk the delta rule's lower-triangular
  system is solved exactly (``torch.linalg.solve_triangular``); ``cu_seqlens`` restarts the state.
* :func:`fla_causal_conv1d` / :func:`l2norm`: flash-linear-attention's ``[b, t, d]`` convolution (with
  ``cu_seqlens``) and its L2 normalisation (``x / sqrt(sum x^2 + eps)``).

Document restarts are exact: the log-decay of a document's first token is set to ``-inf``, and decays
between two positions are sums of log-decays (never differences of cumulative sums), so no ``inf - inf``.
``tests/megatron/test_ssm_kernels.py`` checks every function against a token-by-token float64 recurrence.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_fn", "ssd_chunk_scan", "mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined",
           "RMSNormGated", "rms_norm_gated", "chunk_gated_delta_rule", "fla_causal_conv1d", "l2norm",
           "seq_idx_from_cu_seqlens"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, total]`` int32 document index of every token of a packed sequence (``cu_seqlens[-1] == total``)."""
    cu = cu_seqlens.to(torch.long).cpu()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens {cu.tolist()} must rise from 0 to the packed length {total}")
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), lens).unsqueeze(0)


def _restart_mask(seq_idx: Optional[torch.Tensor], b: int, l: int, device: torch.device) -> Optional[torch.Tensor]:
    """``[b, l]`` bool, True at the first token of every document after the first (state restarts there)."""
    if seq_idx is None:
        return None
    if tuple(seq_idx.shape) != (b, l):
        raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)}, expected (batch, seqlen) = ({b}, {l})")
    seq_idx = seq_idx.to(device)
    out = torch.zeros(b, l, dtype=torch.bool, device=device)
    out[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return out


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation in (None, "identity"):
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation {activation!r}: the CPU causal conv1d supports 'silu'/'swish' or None")


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     seq_idx: Optional[torch.Tensor] = None, initial_states: Optional[torch.Tensor] = None,
                     return_final_states: bool = False, final_states_out: Optional[torch.Tensor] = None,
                     activation: Optional[str] = None) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_fn``: ``x`` ``[b, d, l]``, ``weight`` ``[d, w]``, ``bias`` ``[d]``;
    ``out[:, c, t] = bias[c] + sum_k weight[c, k] * x[:, c, t - (w - 1) + k]`` over positions of the same
    document (``seq_idx`` ``[b, l]``), then the activation. Returns ``[b, d, l]`` in ``x``'s dtype."""
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("the CPU causal conv1d computes training forward passes only (no conv states)")
    b, d, l = x.shape
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"conv1d weight has shape {tuple(weight.shape)}, expected ({d}, width)")
    w = weight.shape[1]
    ct = _compute_dtype(x)
    xf = F.pad(x.to(ct), (w - 1, 0))
    out = torch.zeros(b, d, l, dtype=ct, device=x.device)
    seq = None if seq_idx is None else F.pad(seq_idx.to(x.device).to(torch.long), (w - 1, 0), value=-1)
    for k in range(w):
        term = xf[:, :, k:k + l] * weight[:, k].to(ct)[None, :, None]
        if seq is not None and k < w - 1:  # the tap on the token itself (k = w - 1) is always in its document
            same = (seq[:, k:k + l] == seq[:, w - 1:]).to(ct)
            term = term * same[:, None, :]
        out = out + term
    if bias is not None:
        out = out + bias.to(ct)[None, :, None]
    return _activate(out, activation).to(x.dtype)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``a`` ``[..., T]`` log-decays -> ``[..., T, T]`` with ``[t, s] = sum_{r=s+1..t} a_r`` for ``s <= t`` and
    ``-inf`` above the diagonal. Sums, not differences of cumulative sums: ``-inf`` entries stay exact."""
    t = a.shape[-1]
    rep = a[..., None, :].expand(*a.shape, t).transpose(-1, -2)  # [..., t(row), s(col)] = a[row]
    strict = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1)
    seg = torch.cumsum(rep.masked_fill(~strict, 0.0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=0)
    return seg.masked_fill(~keep, float("-inf"))


def _pad_time(t: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int, D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = (0.0, float("inf")), seq_idx: Optional[torch.Tensor] = None,
                   initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False):
    """The Mamba-2 SSD scan. ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]``, ``B``/``C``
    ``[b, l, g, n]`` (``h % g == 0``), ``D`` ``[h]`` or ``[h, p]``, ``z`` ``[b, l, h, p]``, ``dt_bias`` ``[h]``,
    ``seq_idx`` ``[b, l]``, ``initial_states`` ``[b, h, p, n]``. Returns ``y`` ``[b, l, h, p]`` in ``x``'s dtype
    (and the final states ``[b, h, p, n]`` if asked)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"{h} heads are not a multiple of {g} groups")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    ct = _compute_dtype(x)
    dtf = dt.to(ct)
    if dt_bias is not None:
        dtf = dtf + dt_bias.to(ct)
    if dt_softplus:
        dtf = F.softplus(dtf)
    if tuple(dt_limit) != (0.0, float("inf")):
        dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.to(ct)
    Bh = B.to(ct).repeat_interleave(h // g, dim=2)  # [b, l, h, n]
    Ch = C.to(ct).repeat_interleave(h // g, dim=2)
    a = dtf * A.to(ct)  # [b, l, h] log-decay per step
    restart = _restart_mask(seq_idx, b, l, x.device)
    if restart is not None:
        a = a.masked_fill(restart[:, :, None], float("-inf"))
    q = min(chunk_size, l)
    nc = -(-l // q)
    pad = nc * q - l
    xc, Bc, Cc = (_pad_time(t, 1, pad).reshape(b, nc, q, h, -1) for t in (xf, Bh, Ch))
    dtc = _pad_time(dtf, 1, pad).reshape(b, nc, q, h)
    ac = _pad_time(a, 1, pad).reshape(b, nc, q, h).permute(0, 3, 1, 2)  # [b, h, c, q]
    L = torch.exp(_segsum(ac))  # [b, h, c, q(t), q(s)]
    xdt = xc * dtc[..., None]  # [b, c, q, h, p]
    # within each chunk: y_t += sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} a_r) dt_s x_s
    scores = torch.einsum("bctHn,bcsHn->bHcts", Cc, Bc) * L
    y = torch.einsum("bHcts,bcsHp->bctHp", scores, xdt)
    # state contributed by each chunk at its end, and the decay from a chunk's start to each position
    states = torch.einsum("bHcs,bcsHn,bcsHp->bcHpn", L[..., -1, :], Bc, xdt)
    total = ac.sum(dim=-1)  # [b, h, c]
    from_start = torch.exp(torch.cumsum(ac, dim=-1))  # [b, h, c, q]: exp(sum_{r<=t} a_r)
    carry = (initial_states.to(ct) if initial_states is not None else xf.new_zeros(b, h, p, n))
    entering = []
    for c in range(nc):
        entering.append(carry)
        carry = torch.exp(total[:, :, c])[:, :, None, None] * carry + states[:, c]
    prev = torch.stack(entering, dim=1)  # [b, c, h, p, n]
    y = y + torch.einsum("bctHn,bcHpn,bHct->bctHp", Cc, prev, from_start)
    y = y.reshape(b, nc * q, h, p)[:, :l]
    if D is not None:
        Df = D.to(ct)
        y = y + xf * (Df[None, None, :, None] if Df.dim() == 1 else Df[None, None])
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(x.dtype)
    return (y, carry) if return_final_states else y


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, state_dtype=None):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (training/prefill; no varlen states)."""
    if return_varlen_states:
        raise NotImplementedError("the CPU SSD scan returns no per-document (varlen) states")
    return ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, seq_idx=seq_idx, initial_states=initial_states,
                          return_final_states=return_final_states)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """``mamba_ssm``'s fused training kernel: split ``zxbcdt`` ``[b, l, 2*dim + 2*g*n + h]`` into z, xBC, dt;
    causal conv1d + activation on xBC; SSD scan; ``y * silu(z)`` (or the gated RMSNorm with
    ``rmsnorm_weight``); optional output projection. Returns ``[b, l, dim]`` (or ``[b, l, out]``)."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be given when D is per head")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    b, l, width = zxbcdt.shape
    dim = nheads * headdim
    dstate = (width - 2 * dim - nheads) // ngroups // 2
    if width != 2 * dim + 2 * ngroups * dstate + nheads or dstate <= 0:
        raise ValueError(f"zxbcdt's last dim {width} does not split into z, x, B, C, dt for {nheads} heads of "
                         f"{headdim} and {ngroups} groups")
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(b, l, nheads, headdim)
    B = B.reshape(b, l, ngroups, dstate)
    C = C.reshape(b, l, ngroups, dstate)
    zh = z.reshape(b, l, nheads, headdim)
    out = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=zh if rmsnorm_weight is None else None,
                         dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, seq_idx=seq_idx,
                         initial_states=initial_states, return_final_states=return_final_states)
    out, final = (out if return_final_states else (out, None))
    out = out.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        out = rms_norm_gated(out, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                             norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], z: Optional[torch.Tensor] = None,
                   eps: float = 1e-6, group_size: Optional[int] = None, norm_before_gate: bool = True) -> torch.Tensor:
    """Group RMSNorm with an optional SiLU gate: ``norm(x) * silu(z)`` (``norm_before_gate``) or
    ``norm(x * silu(z))``; groups of ``group_size`` along the last dim. Computed in float32."""
    ct = _compute_dtype(x)
    xf = x.to(ct)
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.to(ct))
    last = xf.shape[-1]
    gs = last if group_size is None else group_size
    if last % gs:
        raise ValueError(f"group size {gs} does not divide the normalised dim {last}")
    xg = xf.reshape(*xf.shape[:-1], last // gs, gs)
    out = (xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)).reshape(xf.shape) * weight.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(ct))
    return out.to(x.dtype)


class RMSNormGated(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: weight of ones, no bias, ``forward(x, z=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return rms_norm_gated(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None, dim: int = -1) -> torch.Tensor:
    """flash-linear-attention's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dim (float32 inside)."""
    ct = _compute_dtype(x)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.square().sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def fla_causal_conv1d(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                      residual: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                      output_final_state: bool = False, activation: Optional[str] = None, backend: Optional[str] = None,
                      cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
    """flash-linear-attention's ``causal_conv1d``: ``x`` ``[b, t, d]``, ``weight`` ``[d, w]``; ``cu_seqlens``
    (with ``b == 1``) keeps documents apart. Returns ``(y, None)``."""
    if initial_state is not None or output_final_state or kwargs.get("cp_context") is not None:
        raise NotImplementedError("the CPU causal conv1d computes training forward passes only (no states, no "
                                  "FLA context parallelism: Megatron's own all-to-all CP is used)")
    seq_idx = None
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of 1, got {x.shape[0]}")
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
    y = causal_conv1d_fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation).transpose(1, 2)
    if residual is not None:
        y = y + residual
    return y, None


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = 64, **kwargs):
    """flash-linear-attention's ``chunk_gated_delta_rule``: ``q``/``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``,
    ``g`` (log decay) and ``beta`` ``[B, T, H]``. Per head, with ``S`` ``[K, V]``::

        S_t = e^{g_t} S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = scale * S_t^T q_t

    In a chunk with entering state ``S0`` and ``G[t, s] = sum_{s<r<=t} g_r``: ``(I + A) u = beta (v - e^{G[t,-1]}
    K S0)`` with ``A[t, s] = beta_t e^{G[t, s]} k_t . k_s`` (``s < t``), solved exactly (unit lower triangular);
    then ``o_t = scale (e^{G[t,-1]} q_t^T S0 + sum_{s<=t} e^{G[t, s]} (q_t . k_s) u_s)``. ``cu_seqlens``
    (``B == 1``) restarts ``S`` at every document. Returns ``(o [B, T, H, V] in v's dtype, final state or None)``."""
    if any(kwargs.get(key) for key in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                                        "state_v_first", "cp_context")):
        raise NotImplementedError(f"the CPU gated delta rule does not implement {sorted(k_ for k_ in kwargs if kwargs[k_])}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3] or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"gated delta rule shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} (value heads must equal key heads here)")
    bsz, t_len, h, dk = k.shape
    dv = v.shape[-1]
    ct = _compute_dtype(v)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = dk ** -0.5 if scale is None else scale
    qf, kf, vf = (t.to(ct).transpose(1, 2) for t in (q, k, v))  # [B, H, T, *]
    gf, bf = (t.to(ct).transpose(1, 2) for t in (g, beta))  # [B, H, T]
    if cu_seqlens is not None:
        if bsz != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of 1, got {bsz}")
        restart = _restart_mask(seq_idx_from_cu_seqlens(cu_seqlens, t_len).to(q.device), 1, t_len, q.device)
        gf = gf.masked_fill(restart[:, None, :], float("-inf"))
    c = min(chunk_size, t_len)
    nc = -(-t_len // c)
    pad = nc * c - t_len
    qc, kc, vc = (_pad_time(t, 2, pad).reshape(bsz, h, nc, c, -1) for t in (qf, kf, vf))
    gc, bc = (_pad_time(t, 2, pad).reshape(bsz, h, nc, c) for t in (gf, bf))
    G = _segsum(gc)  # [B, H, nc, c, c]
    decay = torch.exp(G)
    from_start = torch.exp(torch.cumsum(gc, dim=-1))  # e^{sum_{r<=t} g_r}
    to_end = decay[..., -1, :]  # e^{sum_{s<r<=end} g_r}
    strict = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device), diagonal=-1)
    eye = torch.eye(c, dtype=ct, device=q.device)
    kk = kc @ kc.transpose(-1, -2)
    system = eye + (bc[..., :, None] * decay * kk).masked_fill(~strict, 0.0)
    qk = (qc @ kc.transpose(-1, -2)) * decay  # -inf above the diagonal became 0
    state = (initial_state.to(ct) if initial_state is not None else vf.new_zeros(bsz, h, dk, dv))
    outs = []
    for i in range(nc):
        rhs = bc[:, :, i, :, None] * (vc[:, :, i] - from_start[:, :, i, :, None] * (kc[:, :, i] @ state))
        u = torch.linalg.solve_triangular(system[:, :, i], rhs, upper=False, unitriangular=True)
        o = from_start[:, :, i, :, None] * (qc[:, :, i] @ state) + qk[:, :, i] @ u
        outs.append(o * scale)
        state = torch.exp(gc[:, :, i].sum(-1))[..., None, None] * state \
            + (kc[:, :, i] * to_end[:, :, i, :, None]).transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2)[:, :, :t_len].transpose(1, 2).to(v.dtype)
    return o, (state if output_final_state else None)
