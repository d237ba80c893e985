"""Twelve AdamW steps at CP = 4 follow Megatron's CP = 1 loss curve (fp32; iteration i within the model-level
bound ``i rel_fwd max(|loss|, 1)``, tests/helpers/numerics.py ``model_curve_tols``)."""
from __future__ import annotations

import pytest

from tests.helpers.numerics import Checks, model_curve_tols
from tests.megatron import megatron_workers as W
from tests.megatron.conftest import reference

pytestmark = pytest.mark.slow  # every test here starts worker processes

STEPS = 12


@pytest.mark.slow
def test_cp4_loss_curve_matches_cp1(run):
    ref = reference(STEPS, 1)
    res = run(W.ring_worker, 4, W.MODEL, 1, 4, ["zigzag", "striped"], STEPS, False)[0]["layouts"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference must actually train"
    c = Checks("CP=4 training curve vs CP=1")
    for layout, got in res.items():
        assert len(got["losses"]) == STEPS, (layout, got["losses"])
        for i, (a, b, t) in enumerate(zip(got["losses"], ref["losses"], model_curve_tols(ref["losses"], **W.sizes()))):
            c.add(f"{layout} iteration {i + 1}", abs(a - b), t)
    c.check()
