"""Invalid context-parallel settings fail on every rank with a message naming the flag (never hang:
every run is bounded by the launcher's timeout)."""
from __future__ import annotations

import pytest

from tests.megatron import megatron_workers as W

pytestmark = pytest.mark.slow  # every test here starts worker processes

CASES = {  # case -> (world size, flag the message must name)
    "cp_not_dividing_world": (2, "--context-parallel-size"),
    "tp_cp_not_dividing_world": (2, "--context-parallel-size"),
    "seq_not_divisible_zigzag": (2, "--seq-length"),
    "seq_not_divisible_striped": (2, "--seq-length"),
    "hierarchical_product": (2, "--hierarchical-context-parallel-sizes"),
    "cp_comm_type": (2, "--cp-comm-type"),
    "attention_dropout": (2, "--attention-dropout"),
    "mismatch_with_megatron": (4, "--context-parallel-size"),
    "model_config_mismatch": (2, "--context-parallel-size"),
    "layout_differs_across_ranks": (2, "--cp-layout"),
    "seq_differs_across_ranks": (4, "--seq-length"),
}


@pytest.mark.parametrize("world", [2, 4])
def test_each_bad_config_fails_on_every_rank_naming_the_flag(run, world):
    cases = [c for c, (w, _) in CASES.items() if w == world]
    results = run(W.bad_config_all, world, cases)
    for case in cases:
        flag = CASES[case][1]
        for rank, per_rank in enumerate(results):
            r = per_rank[case]
            assert r["type"] == "ContextParallelConfigError", (case, rank, r)
            assert r["flag"] == flag and flag in r["msg"], (case, rank, r)


def test_hierarchical_sub_rings(run):
    res = run(W.hierarchical_worker, 4, [2, 2])
    expect = {0: [[0, 1], [0, 2]], 1: [[0, 1], [1, 3]], 2: [[2, 3], [0, 2]], 3: [[2, 3], [1, 3]]}
    for rank, r in enumerate(res):
        assert r["ranks"] == expect[rank]
        assert r["sums"] == [float(sum(g)) for g in expect[rank]]
        assert r["idempotent"]
