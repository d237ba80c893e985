"""``python -m megatron_ring_lab.cpu SCRIPT [ARGS...]`` runs a Megatron-LM training script inside the CPU opt-in;
``--list-patches`` prints every attribute the opt-in replaces on this install, read from the lab's patch ledger
(:mod:`megatron_ring_lab.patches`) while the opt-in is entered, then restored."""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
from typing import IO

import torch

from megatron_ring.megatron.compat import has_megatron_training
from megatron_ring_lab import patches
from megatron_ring_lab.cpu.core import megatron_cpu
from megatron_ring_lab.cpu.training import megatron_training_cpu

__all__ = ["main", "harness_scope", "print_patches"]


def harness_scope() -> contextlib.AbstractContextManager:
    """The widest CPU opt-in this install allows: Megatron-LM's loop (``megatron_training_cpu``) where
    ``megatron.training`` is installed and CUDA is not, else megatron-core's (``megatron_cpu``)."""
    if has_megatron_training() and not torch.cuda.is_available():
        return megatron_training_cpu()
    return megatron_cpu()


def print_patches(file: IO[str] | None = None) -> None:
    """Enter :func:`harness_scope`, print one line per ledger entry (target.attribute, by whom), leave it."""
    with harness_scope():
        applied, calls, lines = len(patches.list_patches()), len(patches.during_calls()), patches.describe()
    print(f"# {applied} attributes replaced while the CPU opt-in is active, {calls} more during wrapped calls",
          *lines, sep="\n", file=file)


USAGE = "usage: python -m megatron_ring_lab.cpu SCRIPT [ARGS...] | --list-patches"


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_ring_lab.cpu SCRIPT [ARGS...]`` (or under ``torchrun -m``): run a
    Megatron-LM training script (e.g. a patched ``pretrain_gpt.py``) as ``__main__`` inside the CPU opt-in.
    ``--list-patches``: print what the opt-in replaces (the patch ledger) and exit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit(USAGE)
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "--list-patches":
        print_patches()
        return
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with megatron_training_cpu():
        runpy.run_path(script, run_name="__main__")
