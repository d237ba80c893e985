"""Megatron-LM glue for its 0.19+ model-config path (``pretrain_gpt.py`` -> ``GPTModelConfig`` ->
``GPTModelBuilder``), used by patches/megatron-lm-core_r0.19.0.patch.

:func:`use_ring_attention_in_gpt_config` makes ring attention the core attention of whatever layer spec
Megatron-LM would build (``--transformer-impl local`` or ``transformer_engine``, dense or MoE, ``--spec``)
when ``--context-parallel-size`` > 1: it wraps ``model_cfg.transformer_layer_spec`` with
:func:`~megatron_ring.megatron.spec.layers.with_ring_attention`, registers the ring on Megatron's CP groups
when the model is built, and makes RoPE follow ``--cp-layout`` (a pre-wrap hook).
"""
from __future__ import annotations

import inspect
from typing import Any

from megatron_ring.megatron import compat
from megatron_ring.megatron.arguments import config_from_args
from megatron_ring.megatron.config import ContextParallelConfigError
from megatron_ring.megatron.attention.module import RingDotProductAttention
from megatron_ring.megatron.spec.layers import with_ring_attention
from megatron_ring.megatron.groups.provider import initialize_context_parallel
from megatron_ring.megatron.data.rope import use_layout_rope

__all__ = ["use_ring_attention_in_gpt_config", "uses_ring_attention", "check_attention_backend"]


def uses_ring_attention(args: Any) -> bool:
    """Ring attention replaces core attention whenever the sequence is split (``--context-parallel-size`` > 1)."""
    return getattr(args, "context_parallel_size", 1) > 1


def _backend_name(obj: Any) -> str:
    backend = getattr(obj, "attention_backend", None)
    return str(getattr(backend, "name", backend))


def check_attention_backend(args: Any, model_cfg: Any = None) -> None:
    """At CP > 1, refuse ``attention_backend=local`` (the flag, or a config/YAML setting): it would swap
    Megatron's own ``DotProductAttention`` back in, which cannot run context parallelism."""
    if uses_ring_attention(args) and "local" in (_backend_name(args), _backend_name(model_cfg)):
        raise ContextParallelConfigError(
            "--attention-backend", "'local' swaps Megatron's own DotProductAttention in, which cannot run "
            f"--context-parallel-size {args.context_parallel_size}; megatron_ring's ring attention is the core "
            "attention at CP > 1: drop --attention-backend local (or use auto)")


def use_ring_attention_in_gpt_config(args: Any, model_cfg: Any) -> Any:
    """Put ring attention into ``model_cfg`` (a ``GPTModelConfig``) when ``args.context_parallel_size > 1``.

    ``--attention-backend local`` (which makes Megatron swap core attention back to its own
    ``DotProductAttention``) is refused with an error at CP > 1; any other backend only chooses what the
    ring replaces. Returns ``model_cfg``.
    """
    if not uses_ring_attention(args):
        return model_cfg
    check_attention_backend(args, model_cfg)
    config_from_args(args, validate=False)  # fail on bad --cp-* flags now, before any process group exists
    base = model_cfg.transformer_layer_spec

    def ring_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
        initialize_context_parallel(config_from_args(args), seq_length=args.seq_length)  # idempotent
        if base is None:
            spec = compat.default_gpt_layer_spec(config, vp_stage)
        elif callable(base) and not hasattr(base, "module") and not hasattr(base, "layer_specs"):
            params = inspect.signature(base).parameters
            spec = base(config, vp_stage=vp_stage) if "vp_stage" in params else base(config)
        else:
            spec = base
        spec = with_ring_attention(spec)
        from megatron_ring.megatron.spec import install_mtp_ring_attention

        install_mtp_ring_attention(RingDotProductAttention)  # Megatron rebuilds the MTP block from its own specs
        import torch.distributed as dist

        if dist.get_rank() == 0:
            print(f"> megatron_ring: ring attention is the core attention (CP={args.context_parallel_size}, "
                  f"layout {args.cp_layout}, wire {args.cp_comm_dtype})", flush=True)
        return spec

    def layout_rope_hook(models: Any) -> Any:
        use_layout_rope(models, args.cp_layout)
        return models

    model_cfg.transformer_layer_spec = ring_layer_spec
    model_cfg.pre_wrap_hooks = [*model_cfg.pre_wrap_hooks, layout_rope_hook]
    return model_cfg
