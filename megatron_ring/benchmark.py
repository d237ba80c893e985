"""``python -m megatron_ring.benchmark``: the benchmark CLI (implemented in :mod:`megatron_ring.tools.bench.main`)."""
from megatron_ring.tools.bench.main import main

if __name__ == "__main__":
    main()
