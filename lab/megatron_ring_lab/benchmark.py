"""``python -m megatron_ring_lab.benchmark``: the benchmark CLI (implemented in :mod:`megatron_ring_lab.bench.main`)."""
from megatron_ring_lab.bench.main import main

if __name__ == "__main__":
    main()
