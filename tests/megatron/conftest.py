"""Shared fixtures for the Megatron integration tests (multi-process runs use tests/dist_utils.py)."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))):
    if p not in sys.path:
        sys.path.insert(0, p)

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from dist_utils import run_distributed  # noqa: E402

import megatron_workers as W  # noqa: E402

#: every multi-process run in this directory is bounded by this many seconds
RUN_TIMEOUT = float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "240"))

_REF_CACHE: dict = {}


def reference(steps: int, dp: int, **model_overrides):
    """Megatron-Core's own model (local attention, TP = CP = 1) on one process; cached per setting."""
    m = dict(W.MODEL, **model_overrides)
    key = (steps, dp, tuple(sorted(m.items())))
    if key not in _REF_CACHE:
        _REF_CACHE[key] = run_distributed(W.reference_worker, 1, m, steps, dp, timeout=RUN_TIMEOUT)[0]
    return _REF_CACHE[key]


@pytest.fixture
def run():
    """``run(fn, world_size, *args)``: gloo processes with this directory's timeout."""
    def _run(fn, world_size, *args):
        return run_distributed(fn, world_size, *args, timeout=RUN_TIMEOUT)
    return _run
