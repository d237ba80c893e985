"""Deprecated: the CP doctor moved to the lab (``python -m megatron_ring_lab.doctor``); see CHANGELOG.md."""
