"""Deprecated spelling of ``python -m megatron_ring_lab.cpu``: ``python -m megatron_ring.megatron.training_cpu`` still runs it, with a warning
(:mod:`megatron_ring._moved`)."""
from megatron_ring._moved import run_moved

if __name__ == "__main__":
    run_moved(__spec__.name)
