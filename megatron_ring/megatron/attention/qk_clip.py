"""QK-clip on the ring's core attention: Megatron's ``current_max_attn_logits``.

Megatron's QK-clip (``--qk-clip``; ``--log-max-attention-logit`` logs the same statistic) reads, after each
optimizer step, ``self_attention.core_attention.current_max_attn_logits``: fp32 ``[heads per TP rank]``, the
max of the scaled logits over this rank's batch, accumulated over the step's micro-batches with ``torch.max``,
detached; it all-reduces it with MAX over the data-parallel x context-parallel group, clips the Q/K weights of
the heads above ``--qk-clip-threshold`` and resets it to None (``megatron.core.optimizer.qk_clip``; TE's
``TEDotProductAttention`` keeps it the same way). The ring gives each CP rank the max over its own queries
(``ring_attention(..., return_max_logit=True)``), so after Megatron's MAX all-reduce every rank holds the max
over the whole sequence, as at CP = 1.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ring.megatron import compat
from megatron_ring.megatron.config import ContextParallelConfigError

__all__ = ["requested", "accumulate"]


def requested(config: Any) -> bool:
    """Whether the model asks for the max logit (``config.qk_clip`` or ``config.log_max_attention_logit``);
    ContextParallelConfigError naming the flag on a megatron-core that has no QK-clip to read it."""
    flag = compat.qk_clip_requested(config)
    if flag is not None and not compat.has_qk_clip():
        raise ContextParallelConfigError(flag, "this megatron-core has no QK-clip (megatron.core.optimizer.qk_clip) "
                                               "to read the ring's max attention logits; use a release that has it")
    return flag is not None


def accumulate(current: Optional[torch.Tensor], batch_max: torch.Tensor) -> torch.Tensor:
    """``current_max_attn_logits`` after one more call: the detached ``batch_max`` where Megatron reset it
    (None), else the elementwise max of the two (a new tensor: Megatron all-reduces the attribute in place)."""
    batch_max = batch_max.detach()
    return batch_max if current is None else torch.max(current, batch_max)
