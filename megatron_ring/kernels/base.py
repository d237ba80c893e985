"""The block-kernel protocol (:class:`BlockKernel`: what a kernel takes and returns, kernels/block.py's module doc)
and the process default for deterministic backward kernels."""
from __future__ import annotations

import abc

import torch

__all__ = ["BlockKernel", "set_deterministic", "deterministic"]


class BlockKernel(abc.ABC):
    name: str = "abstract"
    supports_mask: bool = False  # True: forward/backward accept mask= (a masks.BlockMask)
    #: the head dims it takes are multiples of this: a call's operands are zero-padded up to one
    #: (:func:`~megatron_ring.kernels.block.operand_head_dim`, ``kernels/head_dim.py``; exact), as torch's SDPA pads
    #: them for its flash kernel
    head_dim_multiple: int = 1
    #: deterministic backward: True/False as the call asked (select_kernel), None: the process default
    deterministic: bool | None = None

    def is_deterministic(self) -> bool:
        """Whether this kernel must run a deterministic backward (its own flag, else :func:`deterministic`)."""
        return deterministic() if self.deterministic is None else bool(self.deterministic)

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [b,h,sq,d], lse [b,h,sq] fp32)``."""

    @abc.abstractmethod
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this block given the GLOBAL ``out`` and ``lse`` of these query rows."""

    def supports(self, q: torch.Tensor, k: torch.Tensor | None = None, head_dim: int | None = None) -> bool:
        return self.unsupported(q, q.shape[-1] if head_dim is None else head_dim) is None

    def unsupported(self, q: torch.Tensor, head_dim: int) -> str | None:
        """Why this kernel cannot run ``q``'s case with operands of ``head_dim`` (None: it can)."""
        return None

    def unsupported_head_dims(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """Why this kernel cannot take ``v`` of another head dim than ``q`` and ``k`` (multi-latent attention) as
        they are (None: it can; BHSD, the call's local tensors). One that cannot runs them zero-padded to one head
        dim (``kernels/head_dim.py``)."""
        return "it takes one head dim for Q, K and V"


_deterministic: bool | None = None


def set_deterministic(flag: bool | None) -> None:
    """The process default for calls that do not say (``ring_attention(deterministic=None)``): deterministic
    CUDA backward kernels on/off (None: follow torch's deterministic mode). Process-wide; a call's own
    ``deterministic=`` wins, and the Megatron glue passes its layer's ``config.deterministic_mode`` per call."""
    global _deterministic
    _deterministic = flag


def deterministic() -> bool:
    """The process default: :func:`set_deterministic`'s flag, else torch's deterministic mode."""
    return torch.are_deterministic_algorithms_enabled() if _deterministic is None else bool(_deterministic)


def _finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0: their scores are all -inf, so exp(s - 0) = 0."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)
