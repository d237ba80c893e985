"""The doctor catches and names planted CP bugs; the clean control passes (megatron-core 0.19 ``pretrain()``).

tests/megatron/doctor_plants.py is stock_pretrain_gpt.py with documents (attention-mask boundaries) and padded
loss tokens, and one CP bug planted by ``DOCTOR_TEST_PLANT`` (each acts only at CP > 1, so every case shares
the clean CP=1 run through ``--cache``). Each planted run must exit 1 with the planted cause named first;
the control must exit 0. Tiny model, 2 iterations, CP=2.
"""
from __future__ import annotations

import os

import pytest
from tests.megatron.pretrain_cli import CPU_FLAGS, PRETRAIN_MARKS, gpt_args, run_doctor

pytestmark = PRETRAIN_MARKS

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "doctor_plants.py")
ARGS = gpt_args(2) + CPU_FLAGS + ["--calculate-per-token-loss"]


def doctor(tmp_path, cache, plant: str, *extra: str) -> tuple[int, dict, str]:
    return run_doctor(tmp_path, cache, SCRIPT, ARGS, *extra, env_extra={"DOCTOR_TEST_PLANT": plant})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("doctor-cache")


def test_clean_control_passes(tmp_path, cache):
    rc, data, out = doctor(tmp_path, cache, "none")
    assert rc == 0, out
    res = data["results"][0]
    assert res["invariant"] and not res["causes"], out
    # the bounds are not vacuous: the clean run's differences are rounding, far inside them
    grads = next(r for r in res["rows"] if r["quantity"].startswith("gradients after step 1"))
    assert grads["diff"] < grads["tol"] / 20, grads


@pytest.mark.parametrize("plant, cause, first", [
    ("document", "documents", "document starts"),
    ("loss_norm", "per_rank_norm", "training loss"),
    ("rope", "rope", "RoPE"),
    ("unreduced", "unreduced", "gradients"),
])
def test_planted_bug_is_caught_and_named(tmp_path, cache, plant, cause, first):
    rc, data, out = doctor(tmp_path, cache, plant)
    assert rc == 1, out
    res = data["results"][0]
    assert res["training_differs"], out
    assert res["causes"] and res["causes"][0]["key"] == cause, (res["causes"], out)
    assert first in res["first_difference"], (res["first_difference"], out)
    if plant == "unreduced":
        assert "decoder.final_layernorm.weight" in res["first_difference"], out


def test_reporting_only_bug_is_told_from_training(tmp_path, cache):
    rc, data, out = doctor(tmp_path, cache, "report")
    assert rc == 1, out
    res = data["results"][0]
    assert res["reporting_only"] and not res["training_differs"], out
    assert [c["key"] for c in res["causes"]] == ["reporting"], (res["causes"], out)
    assert res["first_difference"].startswith("lm loss (reported)"), out
    assert "reporting only" in res["verdict"], out
