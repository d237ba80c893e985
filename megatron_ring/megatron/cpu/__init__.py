"""Deprecated: the CPU harness moved to the lab (``python -m megatron_ring_lab.cpu``); see CHANGELOG.md."""
