"""Per-layer ``--cp-comm-type`` for :class:`~.attention.RingDotProductAttention` (Megatron's convention).

A layer's type comes from the model config (``TransformerConfig.cp_comm_type``: one string, or a list
of ``num_layers`` entries indexed by the 1-based global layer number minus one), else from the value
Megatron passed to the core attention, else from the registered :class:`~.config.RingConfig`
(``--cp-comm-type`` parsed by :func:`~.arguments.add_context_parallel_args`). When both the model
config and a non-default ring config name a type and they differ, that is an error naming the flag.

Note: Megatron-Core 0.16.1's ``TransformerLayer`` indexes a per-layer list with the 1-based layer
number (an off-by-one fixed upstream); with a list in ``TransformerConfig`` it fails on the last layer
before reaching this module. Give the per-layer list to the ring config (``RingConfig.cp_comm_type`` /
``--cp-comm-type`` through :func:`~.arguments.config_from_args`) and leave ``TransformerConfig.cp_comm_type``
unset on that version.
"""
from __future__ import annotations

from typing import Any

from megatron_ring.megatron.config import CP_COMM_TYPES, ContextParallelConfigError, RingConfig, normalize_comm_type

__all__ = ["layer_comm_type", "strategy_kwargs"]


def layer_comm_type(model_config: Any, layer_number: int, passed: str | None, ring: RingConfig | None) -> str:
    """The comm type of this layer (validated)."""
    cfg_value = normalize_comm_type(getattr(model_config, "cp_comm_type", None))  # "allgather" too
    passed = normalize_comm_type(passed)
    if isinstance(cfg_value, (list, tuple)):
        if not 1 <= layer_number <= len(cfg_value):
            raise ContextParallelConfigError(
                "--cp-comm-type", f"{len(cfg_value)} per-layer values in the model config but layer number "
                                  f"{layer_number}; give one value or one per layer")
        mine = cfg_value[layer_number - 1]
    else:
        mine = cfg_value if cfg_value is not None else passed
    ring_value = ring.comm_type_for_layer(layer_number) if ring is not None else None
    if mine is None:
        mine = ring_value or "p2p"
    elif ring is not None and ring.cp_comm_type != ("p2p",) and ring_value != mine:
        raise ContextParallelConfigError(
            "--cp-comm-type", f"layer {layer_number}: the model config (TransformerConfig.cp_comm_type: "
                              f"--cp-comm-type, whose default on stock Megatron-LM is 'p2p') says {mine!r} but "
                              f"the ring config (MEGATRON_RING_CP_COMM_TYPE, or the RingConfig given to "
                              f"initialize_context_parallel) says {ring_value!r}; set it in one place: on stock "
                              f"Megatron-LM pass --cp-comm-type and leave MEGATRON_RING_CP_COMM_TYPE unset")
    if mine not in CP_COMM_TYPES:
        raise ContextParallelConfigError("--cp-comm-type", f"layer {layer_number}: {mine!r} is not one of "
                                                           f"{list(CP_COMM_TYPES)}")
    return mine


def check_heads(comm_type: str, heads_per_partition: int, ring: RingConfig) -> None:
    """a2a splits a rank's query heads over the CP group (a2a+p2p over the inner group), evenly where they
    divide and unevenly where not (docs/strategies.md, "Heads"); fewer heads than ranks fails at model build."""
    cp = ring.context_parallel_size
    n = {"a2a": cp, "a2a+p2p": (ring.hierarchical_context_parallel_sizes or (cp,))[0]}.get(comm_type)
    if n and heads_per_partition < n:
        raise ContextParallelConfigError(
            "--cp-comm-type", f"{comm_type} splits the {heads_per_partition} attention heads of a rank "
                              f"(num_attention_heads / tensor parallel size) over {n} ranks, but every rank needs "
                              "at least one head; use p2p, all_gather or auto (or a smaller inner size)")


def strategy_kwargs(comm_type: str, state: Any) -> dict[str, Any]:
    """``comm_type`` and ``hierarchical_groups`` for :func:`megatron_ring.ring_attention`."""
    hier = None
    if state is not None and comm_type in ("a2a+p2p", "auto"):
        if len(state.hierarchical_groups) == 2:
            hier = tuple(state.hierarchical_groups)
        elif comm_type == "a2a+p2p" and state.size > 1:
            raise ContextParallelConfigError(
                "--hierarchical-context-parallel-sizes",
                "--cp-comm-type a2a+p2p runs a2a inside the inner group and the ring across the outer one; "
                f"give two sizes (inner, outer) multiplying to the CP size {state.size}, e.g. GPUs per node "
                "and nodes")
    return {"comm_type": comm_type, "hierarchical_groups": hier}
