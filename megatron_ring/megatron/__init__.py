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
import importlib

#: each public name and the module it lives in: imported at first use (PEP 562), so importing one module of
#: this package (``megatron_ring.megatron.compat``: the doctor asks it for megatron-core's version) does not import
#: the rest of the glue and megatron-core with it (about 8 s of CPU on 2 cores); ``from megatron_ring.megatron import
#: X`` is unchanged. :data:`MODULES`: every one of them (what a process imports up front: the fork launcher's preload)
_EXPORTS = {
    "add_context_parallel_args": "megatron_ring.megatron.arguments",
    "config_from_args": "megatron_ring.megatron.arguments",
    "RingDotProductAttention": "megatron_ring.megatron.attention.module",
    "cp_positions": "megatron_ring.megatron.data.batch",
    "get_batch_on_this_cp_rank": "megatron_ring.megatron.data.batch",
    "ContextParallelConfigError": "megatron_ring.megatron.config",
    "RingConfig": "megatron_ring.megatron.config",
    "get_hybrid_cp_batch": "megatron_ring.megatron.data.hybrid_cp",
    "get_gpt_layer_ring_spec": "megatron_ring.megatron.spec.layers",
    "with_ring_attention": "megatron_ring.megatron.spec.layers",
    "use_ring_attention_in_gpt_config": "megatron_ring.megatron.spec.megatron_lm",
    "uses_ring_attention": "megatron_ring.megatron.spec.megatron_lm",
    "CPLoss": "megatron_ring.megatron.data.loss",
    "allreduce_gradients": "megatron_ring.megatron.data.loss",
    "reduce_loss_over_cp": "megatron_ring.megatron.data.loss",
    "RingState": "megatron_ring.megatron.groups.provider",
    "destroy_context_parallel": "megatron_ring.megatron.groups.provider",
    "get_ring_state": "megatron_ring.megatron.groups.provider",
    "initialize_context_parallel": "megatron_ring.megatron.groups.provider",
    "is_context_parallel_initialized": "megatron_ring.megatron.groups.provider",
    "LayoutRotaryEmbedding": "megatron_ring.megatron.data.rope",
    "use_layout_rope": "megatron_ring.megatron.data.rope",
    "cp_invariant_mtp_loss": "megatron_ring.megatron.data.mtp_loss",
    "TokenOrderError": "megatron_ring.megatron.data.token_order",
    "install_thd_partitioner": "megatron_ring.megatron.data.token_order",
    "thd_get_partitioned_indices": "megatron_ring.megatron.data.token_order",
    "ring_layer_spec": "megatron_ring.megatron.spec",
    "ring_spec": "megatron_ring.megatron.spec",
}
MODULES = tuple(dict.fromkeys(_EXPORTS.values()))


__all__ = [
    "add_context_parallel_args", "config_from_args", "RingConfig", "ContextParallelConfigError",
    "initialize_context_parallel", "get_ring_state", "is_context_parallel_initialized",
    "destroy_context_parallel", "RingState", "RingDotProductAttention", "get_gpt_layer_ring_spec", "with_ring_attention",
    "LayoutRotaryEmbedding", "use_layout_rope", "get_batch_on_this_cp_rank", "cp_positions",
    "reduce_loss_over_cp", "allreduce_gradients", "CPLoss", "use_ring_attention_in_gpt_config", "uses_ring_attention",
    "ring_layer_spec", "ring_spec", "cp_invariant_mtp_loss", "get_hybrid_cp_batch",
    "TokenOrderError", "thd_get_partitioned_indices", "install_thd_partitioner",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
