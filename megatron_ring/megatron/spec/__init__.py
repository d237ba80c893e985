"""Ring attention in stock Megatron-LM and Megatron-Bridge, with one line and no patch.

Stock Megatron-LM (``pretrain_gpt.py``)::

    --spec megatron_ring.megatron.spec ring_layer_spec

* Megatron-LM main and core_r0.19 (``GPTModelConfig`` -> ``GPTModelBuilder``): ``ring_layer_spec`` is a
  callable ``ring_layer_spec(config, vp_stage=None)`` returning the spec Megatron would build for this
  config (local or TransformerEngine, dense or MoE, heterogeneous) with only core attention swapped; the
  multi-token-prediction block Megatron rebuilds from its own layer specs gets ring attention too.
* Megatron-LM core_v0.16.1 (``gpt_builders.gpt_builder``) hands the ``--spec`` object to ``GPTModel`` as it
  is, so there the same name is a layer ``ModuleSpec`` (:data:`ring_layer_module_spec`) whose module,
  :class:`RingTransformerLayer`, defers everything to layer build time: each layer is built from Megatron's
  own spec for the config it is given (dense layer spec, or this stage's entry of the MoE block spec) with
  only core attention swapped. It is still callable as ``ring_layer_spec(config, vp_stage=None)``.
  Which of the two ``ring_layer_spec`` is depends on whether this Megatron-LM has ``GPTModelBuilder``
  (``megatron/training/models/gpt.py``, looked up without importing it). Refused by name in this form:
  heterogeneous layer configs (each layer gets a derived config), an MoE block whose final norm would
  differ from ``TransformerBlock``'s ``LayerNormImpl`` (TransformerEngine installed with the local
  implementation), and multi-token prediction where the builder builds the MTP block from Megatron's own
  layer spec (unless :func:`install_mtp_ring_attention` wrapped that builder). core_v0.16.1's own
  ``gpt_builder`` cannot combine any ``--spec`` with ``--mtp-num-layers`` anyway (``use_te`` is unbound,
  gpt_builders.py:84).

Stock Megatron-LM ``pretrain_hybrid.py`` (HybridModel: Mamba-2, GDN, attention, MLP, MoE layers; core_v0.16's
``pretrain_mamba.py``)::

    --spec megatron_ring.megatron.spec ring_hybrid_stack_spec

Megatron's own hybrid stack spec with the attention layers' core attention on the ring (and Mamba / GDN
layers through Megatron's own CP, in the same token order); see :mod:`megatron_ring.megatron.spec.hybrid`.

Megatron-Bridge (any GPT provider; hybrid providers: ``cfg.model.hybrid_stack_spec = ring_hybrid_stack_spec``)::

    cfg.model.transformer_layer_spec = ring_spec(cfg.model.transformer_layer_spec)

What stock Megatron does at CP > 1 is exactly what the ring needs for the zigzag layout: it splits each
sequence zigzag (``get_batch_on_this_cp_rank``), slices RoPE the same way, sums the loss over CP and
averages gradients over DP x CP. The CP group is taken from Megatron at each call. Options a stock script
cannot pass as flags come from ``MEGATRON_RING_*`` environment variables (:mod:`megatron_ring.megatron.env`). Other layouts,
and packed (THD) batches at CP > 1, need a batch split and RoPE stock Megatron does not do: they are
refused by name, pointing to ``examples/pretrain_ring_gpt.py`` or the patch.

Megatron's ``import_module`` (used by ``--spec``) swallows an ``ImportError`` and falls back to its default
spec, so at import this module only defines things (it needs ``ModuleSpec`` and ``BaseTransformerLayer``,
which the package's own imports of megatron-core have loaded already); everything that depends on the
config, and every refusal, happens when the spec or a layer is built. One line at start-up (rank 0) says
which core attention the layers got.
"""
from __future__ import annotations

from typing import Any

from megatron_ring.megatron import compat
from megatron_ring.megatron.spec.deferred import RingLayerSpec, RingTransformerLayer, ring_layer_module_spec
from megatron_ring.megatron.spec.gpt import ring_layer_spec_provider, ring_spec
from megatron_ring.megatron.spec.hybrid import ring_hybrid_stack_spec
from megatron_ring.megatron.spec.mtp import install_mtp_ring_attention
from megatron_ring.megatron.spec.stock import describe_core_attention

__all__ = ["ring_layer_spec", "ring_layer_spec_provider", "ring_layer_module_spec", "RingLayerSpec",
           "RingTransformerLayer", "ring_spec", "describe_core_attention", "install_mtp_ring_attention",
           "ring_hybrid_stack_spec"]

#: ``--spec megatron_ring.megatron.spec ring_layer_spec``: the provider where ``GPTModelBuilder`` calls it,
#: the layer ``ModuleSpec`` where the builder uses it as it is (Megatron-LM core_v0.16, megatron-core alone).
ring_layer_spec: Any = ring_layer_spec_provider if compat.gpt_builder_calls_spec() else ring_layer_module_spec
