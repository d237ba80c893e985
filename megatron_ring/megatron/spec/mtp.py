"""Ring attention in the multi-token-prediction (MTP) block Megatron-LM rebuilds from its own layer specs
(not from ``--spec``): its builders (``compat.MTP_BLOCK_BUILDERS``) are wrapped once, so the block they return
has ring core attention; the MTP loss choice (``data/mtp_loss.py``) is applied and announced there."""
from __future__ import annotations

import sys
from typing import Any, Callable

from megatron_ring.megatron import compat
from megatron_ring.megatron.spec.stock import announce, check_stock_layout, ring_core, transformer_config

__all__ = ["ring_mtp", "install_mtp_ring_attention", "refuse_unswapped_mtp"]

_MTP_CORE: list[Any] = []  # the core attention the wrapped MTP builders swap in (set by the last installer)

def ring_mtp(core: Any = None) -> None:
    """Give multi-token-prediction layers ring attention: Megatron rebuilds the MTP block from its own
    layer specs (:data:`compat.MTP_BLOCK_BUILDERS`), not from ``--spec``. Wraps those builders once (idempotent).
    ``core``: the core attention to swap in (default: the stock-split ring core attention)."""
    _MTP_CORE[:] = [core if core is not None else ring_core()]
    for module, name in compat.loaded_mtp_block_builders():
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, "_megatron_ring", False):
            continue

        def wrapped(*args: Any, __fn: Callable = fn, **kwargs: Any) -> Any:
            out = __fn(*args, **kwargs)
            if out is None:
                return out
            from megatron_ring.megatron.spec.layers import with_ring_attention
            from megatron_ring.megatron.data.mtp_loss import apply_mtp_loss_choice

            check_stock_layout()
            out = with_ring_attention(out, _MTP_CORE[0])
            config = args[0] if args else kwargs.get("config")
            note = apply_mtp_loss_choice(getattr(transformer_config(config), "context_parallel_size", 1) or 1)
            announce("multi-token prediction", out, config, note=note)
            return out

        wrapped._megatron_ring = True  # type: ignore[attr-defined]
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(module, name, wrapped)


def install_mtp_ring_attention(core: Any = None) -> None:
    """Make Megatron-LM's rebuilt multi-token-prediction block use ring attention (see :func:`ring_mtp`)."""
    ring_mtp(core)


def refuse_unswapped_mtp(tc: Any) -> None:
    """The deferred layer cannot reach the multi-token-prediction block: a builder that uses the spec as it
    is builds that block from Megatron's own layer spec first. Refused unless that builder was wrapped."""
    if not getattr(tc, "mtp_num_layers", None):
        return
    for module_name, fn_name in compat.MTP_BLOCK_BUILDERS:
        fn = getattr(sys.modules.get(module_name), fn_name, None)
        if fn is not None and not getattr(fn, "_megatron_ring", False):
            raise NotImplementedError(
                f"--mtp-num-layers {tc.mtp_num_layers} with --spec megatron_ring.megatron.spec ring_layer_spec: "
                f"this Megatron-LM ({module_name}.{fn_name}) builds the multi-token-prediction block from its own "
                "layer spec before any layer exists, so those layers would keep Megatron's core attention. "
                "Call megatron_ring.megatron.spec.install_mtp_ring_attention() after gpt_builders is imported, "
                "or run without --mtp-num-layers")


