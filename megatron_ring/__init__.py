"""megatron_ring: exact context-parallel (ring) attention for Megatron-style training stacks.

Core API (no Megatron import): :func:`ring_attention`, :func:`shard_sequence`, :func:`gather_sequence`.
Megatron-Core glue lives in :mod:`megatron_ring.megatron`.
"""
from .api import ring_attention
from .comm import RingPeerError
from .layouts import get_layout
from .sequence import gather_sequence, shard_sequence

__version__ = "0.1.0"
__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "get_layout", "RingPeerError"]
