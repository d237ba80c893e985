"""The benchmark CLI (``python -m megatron_ring_lab.benchmark``): :mod:`.main` and one module per kind of row."""
