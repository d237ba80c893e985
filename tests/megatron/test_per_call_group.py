"""Ring attention on the group each call brings (``packed_seq_params.cp_group`` / ``local_cp_size``,
Megatron's hybrid / dynamic CP): exact vs the float64 per-document reference, outputs and gradients.

World 4; the model is configured for CP=4 on the whole world (its ``pg_collection.cp``); each call brings
a group of 1, 2 or 4 ranks (size 1: ``local_cp_size=1`` without a group, as Megatron sends it). THD
documents with end padding, causal, GQA (4 query heads, 2 K/V groups), comm types p2p / all_gather / a2a
/ auto. Tolerance: the derived bound of tests/helpers/numerics.py (docs/numerics.md, "Test tolerances").
"""
from __future__ import annotations

from tests.megatron import group_workers as G
import pytest

pytestmark = pytest.mark.slow  # every test here starts worker processes



def test_per_call_groups_of_1_2_4_are_exact_for_every_comm_type(run):
    results = run(G.per_call_group_worker, 4, [1, 2, 4])
    for rank, errs in enumerate(results):
        for ct in G.COMM_TYPES:
            for size in (1, 2, 4):
                ratio = errs[f"{ct}/size{size}"]  # error / derived bound (tests/helpers/numerics.py)
                assert ratio <= 1.0, (rank, ct, size, ratio)
        assert errs["a2a+p2p"].startswith("--cp-comm-type") and "a2a+p2p needs the hierarchical" in errs["a2a+p2p"], \
            (rank, errs["a2a+p2p"])


def test_registration_on_a_pg_collection_builds_no_second_set_of_groups(run):
    for r in run(G.collection_registration_worker, 2):
        assert r == {"same_group": True, "ranks": [0, 1], "parallel_state_built": False}, r
