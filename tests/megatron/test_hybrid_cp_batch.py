"""``get_hybrid_cp_batch``: one document of Megatron's hybrid-CP loop split over its group (issue 21 point 2).

The end-to-end exactness of Megatron's hybrid-CP loop with the ring is tests/megatron/test_hybrid_cp_loop.py
(megatron.training); this file checks the helper itself on megatron-core's own hybrid groups, with tensor
parallelism (the document reaches TP ranks > 0 by broadcast), on every installed megatron-core.
"""
from __future__ import annotations

import pytest
import torch

from tests.megatron import group_workers as G

ps = pytest.importorskip("megatron.core.parallel_state")
if not hasattr(ps, "get_hybrid_data_context_parallel_groups"):
    pytest.skip("this megatron-core has no hybrid context parallel groups", allow_module_level=True)


@pytest.mark.slow
def test_document_split_over_its_hybrid_group_on_every_tp_rank(run):
    for rank, r in enumerate(run(G.hybrid_batch_worker, 4)):
        for size in (1, 2):
            got = r[size]
            assert all(got[k] for k in ("tokens_ok", "labels_ok", "positions_ok", "mask_ok", "group_ok")), \
                (rank, size, got)
            assert (got["local_cp_size"], got["cu"], got["qkv_format"]) == (size, [0, 16], "thd"), (rank, got)
        assert "pad documents to a multiple of 2 x the largest group" in r["uneven"], (rank, r["uneven"])


def test_a_sample_that_is_not_from_the_hybrid_loop_is_refused():
    from megatron_ring.megatron import get_hybrid_cp_batch

    with pytest.raises(ValueError, match="local_cp_size"):
        get_hybrid_cp_batch({"tokens": torch.arange(8)})
