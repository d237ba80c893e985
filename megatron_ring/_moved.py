"""The command spellings that moved to the lab (``megatron_ring_lab``), kept for one release with a warning.

The library never imports the lab: these shims hand the new module's name to :func:`runpy.run_module`, so
``python -m megatron_ring.doctor ...`` still works from a checkout (or where the lab distribution is installed)
and says what to type instead. See CHANGELOG.md.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys

# old ``python -m`` spelling -> the lab module that now runs it
MOVED = {
    "megatron_ring.doctor": "megatron_ring_lab.doctor",
    "megatron_ring.benchmark": "megatron_ring_lab.benchmark",
    "megatron_ring.plan": "megatron_ring_lab.plan",
    "megatron_ring.megatron.cpu": "megatron_ring_lab.cpu",
    "megatron_ring.megatron.training_cpu": "megatron_ring_lab.cpu",
}


def run_moved(spec_name: str) -> None:
    """Run the lab module that replaced ``spec_name`` (a shim's ``__spec__.name``) as ``__main__``."""
    old = spec_name.removesuffix(".__main__")
    new = MOVED[old]
    print(f"megatron_ring: `python -m {old}` is deprecated and will be removed in the next release; "
          f"use `python -m {new}` (CHANGELOG.md)", file=sys.stderr)
    if importlib.util.find_spec(new.split(".")[0]) is None:
        sys.exit(f"megatron_ring: {old} moved to {new}, which is not installed: the lab is its own distribution "
                 "(`pip install ./lab` in a checkout of megatron_ring, or PYTHONPATH=<checkout>/lab)")
    runpy.run_module(new, run_name="__main__", alter_sys=True)
