"""``python -m megatron_ring.planner``: the planner CLI (implemented in :mod:`megatron_ring.tools.planner`)."""
from megatron_ring.tools.planner import main

if __name__ == "__main__":
    main()
