"""``python -m megatron_ring_lab.cpu --list-patches``: every attribute the CPU opt-in replaces on this install,
read from the lab's patch ledger (:mod:`megatron_ring_lab.patches`) while the opt-in is entered, then restored."""
from __future__ import annotations

import contextlib
from typing import IO

import torch

from megatron_ring_lab import patches

__all__ = ["harness_scope", "print_patches"]


def harness_scope() -> contextlib.AbstractContextManager:
    """The widest CPU opt-in this install allows: Megatron-LM's loop (``megatron_training_cpu``) where
    ``megatron.training`` is installed and CUDA is not, else megatron-core's (``megatron_cpu``)."""
    from megatron_ring.megatron.compat import has_megatron_training
    from megatron_ring_lab.cpu import megatron_cpu, megatron_training_cpu

    if has_megatron_training() and not torch.cuda.is_available():
        return megatron_training_cpu()
    return megatron_cpu()


def print_patches(file: IO[str] | None = None) -> None:
    """Enter :func:`harness_scope`, print one line per ledger entry (target.attribute, by whom), leave it."""
    with harness_scope():
        applied, calls, lines = len(patches.list_patches()), len(patches.during_calls()), patches.describe()
    print(f"# {applied} attributes replaced while the CPU opt-in is active, {calls} more during wrapped calls",
          *lines, sep="\n", file=file)
