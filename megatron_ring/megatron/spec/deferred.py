"""The ring layer spec as a layer ``ModuleSpec``, for code that hands a spec object to ``GPTModel`` as it is
(``GPTModel(transformer_layer_spec=ring_layer_module_spec)`` with megatron-core alone, on every supported
release; the builder of a Megatron-LM whose ``--spec`` object is used as it is, which
:func:`~megatron_ring.megatron.compat.gpt_builder_calls_spec` tells apart). Its module,
:class:`RingTransformerLayer`, defers everything to layer build time and returns the layer Megatron's own
spec for that config describes, with ring core attention. Nothing here depends on the release."""
from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from megatron_ring.megatron.spec.gpt import ring_layer_spec_provider, spec_from_transformer_config
from megatron_ring.megatron.spec.mtp import refuse_unswapped_mtp
from megatron_ring.megatron.spec.stock import announce, swap

__all__ = ["RingTransformerLayer", "RingLayerSpec", "ring_layer_module_spec"]


def _pp_rank(pg_collection: Any) -> int | None:
    pp = getattr(pg_collection, "pp", None)
    if pp is None:
        return None
    import torch.distributed as dist

    return pp.rank() if dist.is_initialized() else 0


def _resolve_layer(config: Any, layer_number: int, vp_stage: int | None, pg_collection: Any) -> Any:
    """This layer's spec: Megatron's spec for ``config`` with ring core attention; from a block spec (MoE)
    the entry of this pipeline stage's layer list (Megatron's layer offset is already applied to it)."""
    from megatron.core.transformer import transformer_block as tb

    if getattr(config, "heterogeneous_block_specs", False):
        raise NotImplementedError(
            "ring_layer_spec as a layer ModuleSpec (a spec object used as it is): heterogeneous layer configs "
            "give each layer a derived config, from which Megatron's heterogeneous spec cannot be rebuilt; use "
            "ring_spec(get_gpt_heterogeneous_layer_spec(config, use_te)) in a model provider")
    refuse_unswapped_mtp(config)
    pp_rank = _pp_rank(pg_collection)
    spec = swap(spec_from_transformer_config(config, vp_stage, pp_rank))
    if isinstance(spec, ModuleSpec):
        layer = spec
    else:  # TransformerBlockSubmodules: this stage's layers in order, TransformerBlock numbers them from 1
        # The block around this layer was built from a layer spec, so its final norm is TransformerBlock's
        # LayerNormImpl: equal to the block spec's norm except with TransformerEngine installed and the
        # local implementation; refuse that instead of building a different model.
        if spec.layer_norm is not tb.LayerNormImpl:
            raise NotImplementedError(
                f"ring_layer_spec as a layer ModuleSpec: Megatron's block spec for this config ends with "
                f"{getattr(spec.layer_norm, '__name__', spec.layer_norm)}, a block built from a layer spec with "
                f"{tb.LayerNormImpl.__name__}; use --transformer-impl transformer_engine, or ring_spec(...) on the "
                "block spec in a model provider")
        count = tb.get_num_layers_to_build(config, vp_stage, pp_rank)
        if len(spec.layer_specs) != count or not 1 <= layer_number <= count:
            raise RuntimeError(f"ring_layer_spec: Megatron's block spec lists {len(spec.layer_specs)} layers for "
                               f"this stage, the block builds {count}; layer {layer_number} cannot be matched")
        layer = spec.layer_specs[layer_number - 1]
    if layer_number == 1:
        announce("--spec ring_layer_spec", spec, config)
    return layer


class RingTransformerLayer(BaseTransformerLayer):
    """The module of :data:`ring_layer_module_spec`: never an instance itself. Built as a layer
    (``config``, ``layer_number``, ``pg_collection``, ``vp_stage``, ... from ``TransformerBlock``), it
    returns the layer Megatron's own spec for that config describes, with ring core attention (a
    ``TransformerLayer``, or an MoE layer from the block spec), so the model holds only Megatron's modules."""

    def __new__(cls, config: Any = None, submodules: Any = None, layer_number: int = 1, **kwargs: Any) -> Any:
        if config is None:
            raise TypeError("RingTransformerLayer is built by TransformerBlock with a config (it is the module "
                            "of megatron_ring.megatron.spec.ring_layer_module_spec)")
        if submodules is not None:
            raise TypeError("RingTransformerLayer takes no submodules: it builds Megatron's own for the config")
        layer = _resolve_layer(config, layer_number, kwargs.get("vp_stage"), kwargs.get("pg_collection"))
        return build_module(layer, config=config, layer_number=layer_number, **kwargs)


class RingLayerSpec(ModuleSpec):
    """A layer ``ModuleSpec`` of :class:`RingTransformerLayer`, for builders that use a ``--spec`` object as
    it is (``TransformerBlock`` repeats it once per layer of the stage). Called with ``(config[, vp_stage])`` it is :func:`ring_layer_spec_provider` (returns the spec);
    called with layer arguments it builds the layer, as any ``ModuleSpec``."""

    def __call__(self, config: Any, vp_stage: int | None = None, **layer_kwargs: Any) -> Any:
        if layer_kwargs:
            return build_module(self, config=config, vp_stage=vp_stage, **layer_kwargs)
        return ring_layer_spec_provider(config, vp_stage)


#: ``ring_layer_spec`` for builders that take the object as a spec (also callable like the provider).
ring_layer_module_spec = RingLayerSpec(module=RingTransformerLayer)


