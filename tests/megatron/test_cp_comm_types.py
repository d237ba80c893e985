"""Every ``--cp-comm-type`` (and a mixed per-layer list) inside Megatron-Core matches Megatron's CP = 1.

Same model, reference and tolerances as test_cp_equivalence (GQA 4 heads / 2 groups, RoPE, zigzag,
fp32; the model-level bound of tests/helpers/numerics.py on losses and gradients), 2 steps each. CP = 2: p2p, all_gather,
a2a, auto, and the per-layer list [a2a, all_gather]. CP = 4 (h_kv = 2 < 4: a2a sends each K/V head to two ranks):
a2a, a2a+p2p over hierarchical sizes 2 x 2, auto with those groups, and the list [a2a+p2p, p2p].
"""
from __future__ import annotations

import pytest

from tests.megatron import strategy_workers as SW
from tests.megatron.conftest import reference
from tests.megatron.test_cp_equivalence import STEPS
from tests.helpers.numerics import Checks, add_model_grads, model_loss_tol

from tests.megatron import megatron_workers as W

CASES = {
    2: [("p2p", "p2p", None), ("all_gather", "all_gather", None), ("a2a", "a2a", None), ("auto", "auto", None),
        ("mixed", ["a2a", "all_gather"], None)],
    4: [("a2a", "a2a", None), ("a2a+p2p", "a2a+p2p", (2, 2)), ("auto", "auto", (2, 2)),
        ("mixed", ["a2a+p2p", "p2p"], (2, 2))],
}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_every_comm_type_matches_megatron_cp1(run, cp):
    ref = reference(STEPS, 1)
    res = run(SW.comm_type_worker, cp, W.MODEL, cp, CASES[cp], STEPS)
    c = Checks(f"comm types CP={cp} vs CP=1")
    for label, _, _ in CASES[cp]:
        got = res[0][label]
        assert len(got["losses"]) == len(ref["losses"]), label
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            c.add(f"{label} loss {step}", abs(a - b), model_loss_tol(b, step=step + 1, **W.sizes()))
        for r in res[1:]:
            assert r[label]["losses"] == pytest.approx(got["losses"], abs=1e-6)
        add_model_grads(c, got["grads"], ref["grads"], label=label, **W.sizes())
    c.check()


def test_a2a_p2p_needs_hierarchical_sizes():
    from megatron_ring.megatron import ContextParallelConfigError, RingConfig

    for sizes in (None, (4,), (2, 2, 2)):
        with pytest.raises(ContextParallelConfigError, match="--hierarchical-context-parallel-sizes"):
            RingConfig(context_parallel_size=8 if sizes == (2, 2, 2) else 4, cp_comm_type=["p2p", "a2a+p2p"],
                       hierarchical_context_parallel_sizes=sizes)


def test_per_layer_types_follow_megatron_convention():
    from megatron_ring.megatron import ContextParallelConfigError, RingConfig
    from megatron_ring.megatron.attention.comm_types import layer_comm_type

    ring = RingConfig(context_parallel_size=2, cp_comm_type=["a2a", "all_gather", "auto"])
    assert [ring.comm_type_for_layer(i) for i in (1, 2, 3)] == ["a2a", "all_gather", "auto"]

    class Cfg:
        cp_comm_type = None
    assert layer_comm_type(Cfg, 2, None, ring) == "all_gather"
    Cfg.cp_comm_type = ["p2p", "a2a", "auto"]
    assert layer_comm_type(Cfg, 3, None, None) == "auto"  # list index = layer number - 1
    with pytest.raises(ContextParallelConfigError, match="--cp-comm-type"):
        layer_comm_type(Cfg, 1, None, ring)  # model config and ring config disagree
    with pytest.raises(ContextParallelConfigError, match="--cp-comm-type"):
        RingConfig(context_parallel_size=2, cp_comm_type="ulysses")


def test_a2a_head_check_at_model_build():
    """a2a / a2a+p2p split a rank's heads unevenly where they do not divide (docs/strategies.md, "Heads"):
    the build-time check refuses only fewer heads than ranks, naming the flag."""
    from megatron_ring.megatron import ContextParallelConfigError, RingConfig
    from megatron_ring.megatron.attention import comm_types

    ring = RingConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=(2, 2))
    for ct, heads in (("a2a", 6), ("a2a", 4), ("a2a", 5), ("a2a+p2p", 3), ("a2a+p2p", 2), ("p2p", 1)):
        comm_types.check_heads(ct, heads, ring)
    for ct, heads, n in (("a2a", 3, 4), ("a2a+p2p", 1, 2)):
        with pytest.raises(ContextParallelConfigError, match="at least one head") as e:
            comm_types.check_heads(ct, heads, ring)
        assert e.value.flag == "--cp-comm-type" and f"over {n} ranks" in str(e.value)
