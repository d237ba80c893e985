"""MLA, attention sinks and attention dropout through the Megatron spec: CP > 1 equals CP = 1.

Reference (see ``feature_workers``): Megatron-Core's own DotProductAttention at TP = CP = 1 (MLA via
``MLASelfAttention``; sinks via ``softmax_type`` "off-by-one" / "learnable", whose ``softmax_offset``
parameter gets compared gradients too); attention dropout 0.2 in training mode against the ring spec at
CP = 1 with the same Megatron seed. Under test: ``get_gpt_layer_ring_spec(multi_latent_attention=...)`` at
CP = 2 (zigzag and striped) and CP = 4 (zigzag), two optimizer steps.

Tolerances (fp32): the model-level rule of tests/helpers/numerics.py (loss of iteration i within
``i rel_fwd max(|loss|, 1)``, each gradient tensor within ``rel_grad max |g_ref|``; FW.BASE's sizes).
"""
from __future__ import annotations

import pytest

from tests.helpers.numerics import Checks, add_model_grads, model_loss_tol
from tests.megatron import feature_workers as FW
from tests.megatron import megatron_workers as W
from tests.megatron.conftest import RUN_TIMEOUT
from tests.helpers.launch import run_distributed

pytestmark = pytest.mark.slow  # every test here starts worker processes

STEPS = 2
_REF: dict = {}


def _reference():
    if not _REF:
        _REF.update(run_distributed(FW.reference_worker, 1, STEPS, timeout=RUN_TIMEOUT)[0])
    return _REF


def _check(got: dict, layouts, cases=FW.CASES):
    ref, sizes, c = _reference(), W.sizes(FW.BASE), Checks("MLA / sinks / dropout CP vs CP=1")
    for layout in layouts:
        for case in cases:
            g, r = got[(case, layout)], ref[case]
            assert len(g["losses"]) == len(r["losses"]), (case, layout)
            for step, (a, b) in enumerate(zip(g["losses"], r["losses"])):
                c.add(f"{case} {layout} loss {step}", abs(a - b), model_loss_tol(b, step=step + 1, **sizes))
            add_model_grads(c, g["grads"], r["grads"], label=f"{case} {layout}", **sizes)
    c.check()
    return ref


def test_cp2_matches_cp1_mla_sinks_dropout():
    got = run_distributed(FW.ring_worker, 2, ["zigzag", "striped"], STEPS, timeout=RUN_TIMEOUT * 2)[0]
    ref = _check(got, ["zigzag", "striped"])
    assert any("softmax_offset" in n for n in ref["sink_learnable"]["grads"])  # the sink is learned
    assert any("softmax_offset" in n for n in ref["mla_sink_dropout"]["grads"])


@pytest.mark.slow
def test_cp4_matches_cp1_dropout_and_mla():
    cases = ("mla_sink_dropout", "dropout")
    got = run_distributed(FW.ring_worker, 4, ["zigzag"], STEPS, cases, timeout=RUN_TIMEOUT * 2)[0]
    _check(got, ["zigzag"], cases)


def test_dropout_is_active_in_training_only():
    """Negative control for the dropout equality above: in training mode the dropout model's output
    differs from eval mode and from call to call (the seed advances with Megatron's RNG state); in eval
    mode there is no dropout (two calls agree exactly)."""
    res = run_distributed(FW.eval_worker, 1, timeout=RUN_TIMEOUT)[0]
    assert res == dict(train_vs_eval=True, train_vs_train=True, eval_vs_eval=True), res
