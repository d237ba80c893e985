"""``python -m megatron_ring_lab.cpu SCRIPT [ARGS...]`` (or ``torchrun ... -m megatron_ring_lab.cpu``):
run a Megatron-LM training script as ``__main__`` inside the CPU opt-in; ``--list-patches`` prints what the
opt-in replaces (target, attribute, by whom) and exits."""
from megatron_ring_lab.cpu.cli import main

if __name__ == "__main__":
    main()
