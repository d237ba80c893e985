"""Megatron-Core integration of megatron_ring (the only subpackage that imports megatron).

Stock Megatron-LM: ``--spec megatron_ring.megatron.spec ring_layer_spec``; Megatron-Bridge:
``cfg.model.transformer_layer_spec = ring_spec(cfg.model.transformer_layer_spec)`` (see :mod:`megatron_ring.megatron.spec`).

Typical use in your own loop (see examples/train_gpt.py)::

    from megatron_ring.megatron import (initialize_context_parallel, RingConfig, get_gpt_layer_ring_spec, use_layout_rope, get_batch_on_this_cp_rank, reduce_loss_over_cp)

    state = initialize_context_parallel(RingConfig(context_parallel_size=4, layout="zigzag"),
                                        tensor_model_parallel_size=1)
    model = GPTModel(config, get_gpt_layer_ring_spec(), ...); use_layout_rope(model)
    batch = get_batch_on_this_cp_rank(batch)

The CPU harness that lets megatron-core run on CPU/gloo (``megatron_cpu``) is part of the lab, not of this
package: ``from megatron_ring_lab.cpu import megatron_cpu`` (a checkout's ``lab/``).
"""
from megatron_ring.megatron.arguments import add_context_parallel_args, config_from_args
from megatron_ring.megatron.attention.module import RingDotProductAttention
from megatron_ring.megatron.data.batch import cp_positions, get_batch_on_this_cp_rank
from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig
from megatron_ring.megatron.data.hybrid_cp import get_hybrid_cp_batch
from megatron_ring.megatron.spec.layers import get_gpt_layer_ring_spec, with_ring_attention
from megatron_ring.megatron.spec.megatron_lm import use_ring_attention_in_gpt_config, uses_ring_attention
from megatron_ring.megatron.data.loss import CPLoss, allreduce_gradients, reduce_loss_over_cp
from megatron_ring.megatron.groups.provider import (RingState, destroy_context_parallel, get_ring_state, initialize_context_parallel, is_context_parallel_initialized)
from megatron_ring.megatron.data.rope import LayoutRotaryEmbedding, use_layout_rope
from megatron_ring.megatron.data.mtp_loss import cp_invariant_mtp_loss
from megatron_ring.megatron.data.token_order import TokenOrderError, install_thd_partitioner, thd_get_partitioned_indices
from megatron_ring.megatron.spec import ring_layer_spec, ring_spec

__all__ = [
    "add_context_parallel_args", "config_from_args", "RingConfig", "ContextParallelConfigError",
    "initialize_context_parallel", "get_ring_state", "is_context_parallel_initialized",
    "destroy_context_parallel", "RingState", "RingDotProductAttention", "get_gpt_layer_ring_spec", "with_ring_attention",
    "LayoutRotaryEmbedding", "use_layout_rope", "get_batch_on_this_cp_rank", "cp_positions",
    "reduce_loss_over_cp", "allreduce_gradients", "CPLoss", "use_ring_attention_in_gpt_config", "uses_ring_attention",
    "ring_layer_spec", "ring_spec", "cp_invariant_mtp_loss", "get_hybrid_cp_batch",
    "TokenOrderError", "thd_get_partitioned_indices", "install_thd_partitioner",
]
