"""The benchmark CLI (``python -m megatron_ring.benchmark``): :mod:`.main` and one module per kind of row."""
