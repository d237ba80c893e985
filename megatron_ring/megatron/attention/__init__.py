"""Ring attention as Megatron-Core's core attention: the module (:mod:`.module`), its per-layer comm type
(:mod:`.comm_types`), attention sinks (:mod:`.sinks`) and dropout seeds (:mod:`.dropout`)."""
from megatron_ring.megatron.attention.module import RingDotProductAttention

__all__ = ["RingDotProductAttention"]
