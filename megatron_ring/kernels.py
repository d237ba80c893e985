"""Local block attention kernels that also return the log-sum-exp, with matching backward.

All tensors are BHSD: ``q [b, h, sq, d]``, ``k, v [b, h_kv, sk, d]`` with ``h % h_kv == 0`` (GQA is
handled inside the kernel; K/V are never repeated on the wire). ``forward`` returns
``(out [b, h, sq, d] in q.dtype, lse [b, h, sq] float32, natural log)``; ``backward`` returns
``(dq, dk, dv)`` shaped like ``q, k, v``. ``causal`` is the top-left mask (key j visible to query i iff
j <= i). Callers never pass a block with a fully masked query row (see ``layouts``).

Masks (documents, windows; see :mod:`.masks`): a kernel with ``supports_mask = True`` also accepts the
keyword ``mask=`` (a :class:`~megatron_ring.masks.BlockMask`, ``causal`` is then False). With a mask,
query rows that see no key of the block return out 0 and lse -inf, and ``backward`` accepts lse = -inf
for rows that see no key at all (their gradients are 0). The engine sends masked tasks to a kernel
without ``supports_mask`` to :class:`MathKernel` instead, so a new kernel works unchanged.

Kernels are picked once per device by :func:`select_kernel` and can be forced by name.
"""
from __future__ import annotations

import abc
from typing import Callable

import torch

__all__ = ["BlockKernel", "MathKernel", "FlashCPUKernel", "CudaSDPAKernel", "select_kernel", "KERNELS"]


class BlockKernel(abc.ABC):
    name: str = "abstract"
    supports_mask: bool = False  # True: forward/backward accept mask= (a masks.BlockMask)

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [b,h,sq,d], lse [b,h,sq] fp32)``."""

    @abc.abstractmethod
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this block given the GLOBAL ``out`` and ``lse`` of these query rows."""

    def supports(self, q: torch.Tensor) -> bool:
        return True


class MathKernel(BlockKernel):
    """Plain fp32 matmul/softmax. Slow, exact, works on every device and dtype."""

    name = "math"
    supports_mask = True

    @staticmethod
    def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
        b, h, s, d = q.shape
        return q.reshape(b, h_kv, h // h_kv, s, d)

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, mask=None) -> torch.Tensor:
        qg = MathKernel._grouped(q.float(), k.shape[1])
        s = torch.einsum("bkgqd,bksd->bkgqs", qg, k.float()) * scale
        if causal:
            sq, sk = s.shape[-2:]
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(1)
            s = s.masked_fill(hidden, float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask.allowed(q.device), float("-inf"))
        return s

    def forward(self, q, k, v, causal, scale, mask=None):
        s = self._scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite_lse(lse).unsqueeze(-1))  # rows with no key: all zeros
        out = torch.einsum("bkgqs,bksd->bkgqd", p, v.float())
        b, h, sq, d = q.shape
        return out.reshape(b, h, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, h, sq)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        h_kv = k.shape[1]
        s = self._scores(q, k, causal, scale, mask)
        lse_g = self._grouped(_finite_lse(lse).unsqueeze(-1), h_kv)
        p = torch.exp(s - lse_g)
        do = self._grouped(dout.float(), h_kv)
        delta = (do * self._grouped(out.float(), h_kv)).sum(-1, keepdim=True)
        dv = torch.einsum("bkgqs,bkgqd->bksd", p, do)
        dp = torch.einsum("bkgqd,bksd->bkgqs", do, v.float())
        ds = p * (dp - delta) * scale
        dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k.float()).reshape(q.shape)
        dk = torch.einsum("bkgqs,bkgqd->bksd", ds, self._grouped(q.float(), h_kv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashCPUKernel(BlockKernel):
    """torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) and its backward."""

    name = "flash_cpu"
    supports_mask = True  # as a float additive mask in q's dtype

    def supports(self, q):
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16,
                                                      torch.float64)

    def forward(self, q, k, v, causal, scale, mask=None):
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        allowed = mask.allowed(q.device)
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=additive, scale=scale)
        empty = ~allowed.any(-1)  # this kernel returns lse 0 (not -inf) for rows that see no key
        return out.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, float("-inf"))

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        additive = mask.additive(q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, _finite_lse(lse).contiguous(), 0.0, False, attn_mask=additive, scale=scale)


def _finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0: their scores are all -inf, so exp(s - 0) = 0."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


class CudaSDPAKernel(BlockKernel):
    """torch's memory-efficient CUDA SDPA op (returns the lse). GQA K/V are expanded locally only.

    Not exercised on this project's CPU CI; see docs/multinode.md for how to validate it on GPUs.
    """

    name = "sdpa_cuda"

    def supports(self, q):
        return q.device.type == "cuda"

    def forward(self, q, k, v, causal, scale):
        g = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[1] // k.shape[1]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        sq = q.shape[2]
        lse_padded = lse.new_zeros(*lse.shape[:-1], -(-sq // 32) * 32)  # the kernel's row granularity
        lse_padded[..., :sq] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, g), _repeat_kv(v, g), None, out, lse_padded, zero, zero,
            0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)


class FlashAttnKernel(BlockKernel):
    """The ``flash_attn`` package (imported lazily; CUDA only). Uses its BSHD layout internally."""

    name = "flash_attn"

    def __init__(self) -> None:
        self._mod = None

    def _impl(self):
        if self._mod is None:
            import flash_attn.flash_attn_interface as fa  # noqa: PLC0415 - optional, GPU only
            self._mod = fa
        return self._mod

    def supports(self, q):
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        try:
            self._impl()
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            return False
        return True

    def forward(self, q, k, v, causal, scale):
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        res = self._impl()._flash_attn_forward(t(q), t(k), t(v), 0.0, scale, causal=causal,
                                               window_size_left=-1, window_size_right=-1,
                                               softcap=0.0, alibi_slopes=None, return_softmax=False)
        return res[0].transpose(1, 2), res[1].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        dq, dk, dv = (torch.empty_like(t(x)) for x in (q, k, v))
        self._impl()._flash_attn_backward(t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), dq, dk, dv,
                                          0.0, scale, causal, -1, -1, 0.0, None, False)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


KERNELS: dict[str, Callable[[], BlockKernel]] = {
    "flash_cpu": FlashCPUKernel,
    "math": MathKernel,
    "sdpa_cuda": CudaSDPAKernel,
    "flash_attn": FlashAttnKernel,
}
_AUTO_ORDER = ("flash_attn", "sdpa_cuda", "flash_cpu", "math")
_instances: dict[str, BlockKernel] = {}
_auto_choice: dict[tuple[str, torch.dtype], BlockKernel] = {}


def _instance(name: str) -> BlockKernel:
    if name not in _instances:
        _instances[name] = KERNELS[name]()
    return _instances[name]


def select_kernel(q: torch.Tensor, kernel: str | BlockKernel = "auto") -> BlockKernel:
    """The kernel for ``q``'s device/dtype: ``"auto"`` picks once per (device type, dtype) and caches."""
    if isinstance(kernel, BlockKernel):
        return kernel
    if kernel != "auto":
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; use 'auto' or one of {sorted(KERNELS)}")
        chosen = _instance(kernel)
        if not chosen.supports(q):
            raise ValueError(f"kernel {kernel!r} does not support {q.dtype} tensors on {q.device.type}; "
                             "use kernel='auto' or kernel='math'")
        return chosen
    key = (q.device.type, q.dtype)
    if key not in _auto_choice:
        _auto_choice[key] = next(k for k in map(_instance, _AUTO_ORDER) if k.supports(q))
    return _auto_choice[key]
