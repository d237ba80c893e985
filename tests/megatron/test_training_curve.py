"""Twelve AdamW steps at CP = 4 follow Megatron's CP = 1 loss curve (fp32, |diff| <= 1e-4 per step)."""
from __future__ import annotations

import pytest

from tests.megatron import megatron_workers as W
from tests.megatron.conftest import reference

pytestmark = pytest.mark.slow  # every test here starts worker processes

STEPS = 12


@pytest.mark.slow
def test_cp4_loss_curve_matches_cp1(run):
    ref = reference(STEPS, 1)
    res = run(W.ring_worker, 4, W.MODEL, 1, 4, ["zigzag", "striped"], STEPS, False)[0]["layouts"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference must actually train"
    for layout, got in res.items():
        diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
        assert len(diffs) == STEPS and max(diffs) <= 1e-4, (layout, got["losses"], ref["losses"])
