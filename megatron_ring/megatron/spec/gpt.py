"""GPT layer specs with ring attention: Megatron's own spec for a config (what its GPT builders choose),
as the ``--spec`` provider, and Megatron-Bridge's one-line wrapper of any spec or spec provider."""
from __future__ import annotations

import inspect
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.megatron import compat
from megatron_ring.megatron.spec.hybrid import is_hybrid_stack_spec, ring_hybrid_spec
from megatron_ring.megatron.spec.mtp import ring_mtp
from megatron_ring.megatron.spec.stock import announce, swap

__all__ = ["megatron_default_spec", "spec_from_transformer_config", "ring_layer_spec_provider", "ring_spec"]


def megatron_default_spec(config: Any, vp_stage: int | None) -> Any:
    """The layer/block spec Megatron builds for ``config`` (``GPTModelConfig`` or ``TransformerConfig``)."""
    if compat.is_gpt_model_config(config):
        return compat.default_gpt_layer_spec(config, vp_stage)
    return spec_from_transformer_config(config, vp_stage)


def spec_from_transformer_config(tc: Any, vp_stage: int | None, pp_rank: int | None = None) -> Any:
    """What Megatron's GPT builders choose for a ``TransformerConfig``: MoE block, heterogeneous, or layer."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = getattr(tc, "transformer_impl", "local") == "transformer_engine"
    if getattr(tc, "experimental_attention_variant", None) is not None:
        raise NotImplementedError("ring_layer_spec: experimental attention variants have their own core "
                                  "attention; ring attention replaces dot-product attention only")
    if getattr(tc, "use_kitchen", False) or getattr(tc, "transformer_impl", None) == "inference_optimized":
        raise NotImplementedError("ring_layer_spec: kitchen and inference-optimized layers have their own Megatron "
                                  "spec builders, which this one does not rebuild; wrap that spec with "
                                  "ring_spec(...) in a model provider instead")
    if getattr(tc, "num_moe_experts", None):
        return compat.call_with_supported_kwargs(
            specs.get_gpt_decoder_block_spec, dict(config=tc, use_transformer_engine=use_te,
                                                   normalization=tc.normalization,
                                                   qk_l2_norm=getattr(tc, "qk_l2_norm", False), vp_stage=vp_stage,
                                                   pp_rank=pp_rank),
            defaults={"pp_rank": None})
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    if isinstance(tc, HeterogeneousTransformerConfig):
        from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

        return get_gpt_heterogeneous_layer_spec(tc, use_te)
    kwargs = dict(num_experts=None, moe_grouped_gemm=False, qk_layernorm=tc.qk_layernorm,
                  multi_latent_attention=tc.multi_latent_attention, qk_l2_norm=getattr(tc, "qk_l2_norm", False))
    if use_te:
        return compat.call_with_supported_kwargs(specs.get_gpt_layer_with_transformer_engine_spec, kwargs,
                                                 defaults={})
    return compat.gpt_layer_local_spec(normalization=tc.normalization, **kwargs)


def ring_layer_spec_provider(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's own spec for ``config`` with ring attention as core attention: ``--spec
    megatron_ring.megatron.spec ring_layer_spec`` on Megatron-LM main / core_r0.19 (``GPTModelBuilder``
    calls it with the ``GPTModelConfig``), or any builder that calls ``f(config, vp_stage=...)`` with a
    ``TransformerConfig``."""
    spec = swap(megatron_default_spec(config, vp_stage))
    ring_mtp()
    announce("--spec ring_layer_spec", spec, config)
    return spec


def ring_spec(spec: Any) -> Any:
    """Megatron-Bridge's one line: ``cfg.model.transformer_layer_spec = ring_spec(cfg.model.transformer_layer_spec)``.

    ``spec``: a ``ModuleSpec`` / block spec (returned with core attention swapped), or a callable spec
    provider ``f(config[, vp_stage])`` (returned as a callable of the same form whose result is swapped).
    A hybrid stack spec (``HybridStack`` / ``MambaStack``: Megatron-Bridge's ``hybrid_stack_spec``) becomes
    what ``ring_hybrid_stack_spec`` is built from (:func:`~megatron_ring.megatron.spec.hybrid.ring_hybrid_spec`).
    """
    if is_hybrid_stack_spec(spec):
        return ring_hybrid_spec(spec)
    if isinstance(spec, ModuleSpec) or hasattr(spec, "layer_specs") or not callable(spec):
        return swap(spec)
    takes_vp = "vp_stage" in inspect.signature(spec).parameters

    if takes_vp:
        def provider(config: Any, vp_stage: int | None = None) -> Any:
            out = spec(config, vp_stage=vp_stage)
            if is_hybrid_stack_spec(out):
                return ring_hybrid_spec(out)  # its stack announces when it is built
            out = swap(out)
            announce("ring_spec", out, config)
            return out
    else:
        def provider(config: Any) -> Any:  # type: ignore[misc]
            out = spec(config)
            if is_hybrid_stack_spec(out):
                return ring_hybrid_spec(out)
            out = swap(out)
            announce("ring_spec", out, config)
            return out
    provider.__name__ = f"ring_spec({getattr(spec, '__name__', type(spec).__name__)})"
    provider.__wrapped__ = spec  # type: ignore[attr-defined]
    return provider

