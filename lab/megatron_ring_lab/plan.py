"""``python -m megatron_ring_lab.plan``: the planner CLI (implemented in :mod:`megatron_ring_lab.planner`)."""
from megatron_ring_lab.planner import main

if __name__ == "__main__":
    main()
