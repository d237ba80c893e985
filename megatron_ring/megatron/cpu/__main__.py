"""``python -m megatron_ring.megatron.cpu SCRIPT [ARGS...]`` (or ``torchrun ... -m megatron_ring.megatron.cpu``):
run a Megatron-LM training script as ``__main__`` inside the CPU opt-in."""
from megatron_ring.megatron.cpu.training import main

if __name__ == "__main__":
    main()
