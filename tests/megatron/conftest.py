"""Shared fixtures for the Megatron integration tests (multi-process runs: tests/helpers/launch.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from tests.helpers.launch import TIMEOUT_S, run_distributed  # noqa: E402
from tests.megatron import megatron_workers as W  # noqa: E402

#: every multi-process run in this directory is bounded by this many seconds (MEGATRON_RING_TEST_TIMEOUT)
RUN_TIMEOUT = TIMEOUT_S

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
