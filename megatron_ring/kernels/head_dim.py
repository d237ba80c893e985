""":class:`HeadDimPadKernel` — a kernel's operands zero-padded to one head dim ``d``, in two cases:

* V's head dim ``d_v`` differs from Q/K's ``d_qk`` (multi-latent attention). torch's flash ops (CPU and CUDA,
  variable-length too) and flash-attn 2 require equal head dims, so V (and dO, O in backward) are padded to
  ``d_qk`` when ``d_v < d_qk``, Q and K to ``d_v`` otherwise. A kernel that takes them as they are
  (:meth:`~megatron_ring.kernels.base.BlockKernel.unsupported_head_dims`: the math kernels; cuDNN where torch's own
  SDPA hands it those head dims) is not wrapped;
* the head dim is not a multiple of what the kernel takes (the fused CUDA kernels: 8,
  :attr:`~megatron_ring.kernels.block.BlockKernel.head_dim_multiple`): every operand is padded up to the next
  multiple (``operand_head_dim``), as torch's SDPA pads them for its flash kernel.

Zero columns of Q and K add nothing to a score; zero columns of V give zero output columns and change no other
column. The softmax scale is the call's (its head dim's, not the padded one's: the kernels take it as given),
so the result is exact; the padded columns are sliced off the output and the gradients. Only the kernel's
operands are padded: K and V travel the ring unpadded, as one packed buffer (the codecs pack K and V with
separate shapes).

In the engine's rings the operands are padded once, not per kernel call (:class:`RingPads`): the operands every
step shares (Q in the forward; dO, Q and O in the backward) once per ring, and each visiting K/V block once per
step, copied into a buffer whose zero columns are written once per ring. The kernel is then told the true head
dims (``dims``), which the padded operands no longer show.
"""
from __future__ import annotations

import functools

import torch

from megatron_ring.kernels.block import BlockKernel

__all__ = ["HeadDimPadKernel", "padded_kernel", "RingPads", "pads_to"]


def _outer_order(x: torch.Tensor) -> list[int]:
    """``x``'s dims but the last, outermost first by stride (stable: ties, size-1 dims, keep their order)."""
    return sorted(range(x.dim() - 1), key=lambda i: -x.stride(i))


def _pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` zero-padded to head dim ``d``, in ``x``'s memory order (its dims ordered by stride, the head dim
    innermost): a padded ``out`` keeps the layout the kernel's forward gave it (q's), as an unpadded one does, and
    cuDNN keys its cached backward plans on q, k and v only (docs/design.md, "cuDNN's graph cache")."""
    if x.shape[-1] == d:
        return x
    outer = _outer_order(x)
    order = [*outer, x.dim() - 1]
    buf = x.new_zeros([x.shape[i] for i in outer] + [d]).permute(*(order.index(i) for i in range(x.dim())))
    buf[..., : x.shape[-1]].copy_(x)
    return buf


class HeadDimPadKernel(BlockKernel):
    """Runs ``base`` on operands zero-padded to head dim ``d`` (exact, see the module docstring); stateless, one
    object per (base, d): :func:`padded_kernel`."""

    def __init__(self, base: BlockKernel, d: int) -> None:
        self.base = base
        self.d = d
        self.name = f"{base.name}+pad"
        self.supports_mask = base.supports_mask
        self.head_dim_multiple = base.head_dim_multiple

    def unsupported(self, q, head_dim):
        return self.base.unsupported(q, head_dim)

    @property
    def takes_kernel_lse(self) -> bool:
        """As the base kernel (kernels/varlen.py: the lse in the kernel's own convention, passed through)."""
        return getattr(self.base, "takes_kernel_lse", False)

    def forward(self, q, k, v, causal, scale, dims=None, **kw):
        """``dims``: the true ``(d_qk, d_v)`` where the operands come padded already (:class:`RingPads`); None:
        theirs."""
        dv, d = dims[1] if dims else v.shape[-1], self.d
        out, lse = self.base.forward(_pad_last(q, d), _pad_last(k, d), _pad_last(v, d), causal, scale, **kw)
        return out[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, dims=None, **kw):
        dqk, dv_dim = dims or (q.shape[-1], v.shape[-1])
        d = self.d
        dq, dk, dv = self.base.backward(_pad_last(dout, d), _pad_last(q, d), _pad_last(k, d), _pad_last(v, d),
                                        _pad_last(out, d), lse, causal, scale, **kw)
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]


@functools.lru_cache(maxsize=64)
def padded_kernel(base: BlockKernel, d: int) -> HeadDimPadKernel:
    """``base`` on operands padded to head dim ``d``: one object per (kernel object, d), so a call's plan, its masked
    tasks' kernel (kernels/varlen.py) and every later call share it."""
    return HeadDimPadKernel(base, d)


def pads_to(kernel: BlockKernel) -> int | None:
    """The head dim ``kernel`` pads its operands to (a :class:`HeadDimPadKernel`, or a kernel running one on
    reordered rows: ``inner``); None: it takes them as they are."""
    while not isinstance(kernel, HeadDimPadKernel):
        kernel = getattr(kernel, "inner", None)
        if kernel is None:
            return None
    return kernel.d


class RingPads:
    """The operands of one ring (a forward or a backward) padded to head dim ``d`` for a :class:`HeadDimPadKernel`,
    each once: :meth:`once` for what every step shares (the result lives for the ring), :meth:`block` for a
    visiting K/V block, copied into a buffer made (zeroed) at its first use and reused every later step: one copy
    per operand and step instead of a zeroed buffer and a copy per kernel call. A block's buffer is rewritten by
    the next step's :meth:`block`; the kernels read it before (stream order on CUDA), nothing keeps it."""

    def __init__(self, d: int) -> None:
        self.d = d
        self._buffers: dict[tuple, torch.Tensor] = {}

    def once(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` padded (:func:`_pad_last`: in ``x``'s memory order); ``x`` itself where it has ``d`` already."""
        return _pad_last(x, self.d)

    def block(self, x: torch.Tensor, role: str) -> torch.Tensor:
        """``x`` (``role``: which operand, so K and V never share a buffer) padded into this ring's buffer for its
        shape, memory order and dtype, laid out as :func:`_pad_last` lays it out."""
        if x.shape[-1] == self.d:
            return x
        key = (role, tuple(x.shape), tuple(_outer_order(x)), x.dtype, x.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = _pad_last(x, self.d)
        else:
            buf[..., : x.shape[-1]].copy_(x)
        return buf
