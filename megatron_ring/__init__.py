"""megatron_ring: exact context-parallel (ring) attention for Megatron-style training stacks."""
__version__ = "0.1.0"
