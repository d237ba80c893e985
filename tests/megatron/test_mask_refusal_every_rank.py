"""A ``--reset-attention-mask`` style mask that is not causal within documents on only SOME CP ranks' query rows
(a prefix-LM mask whose non-causal pair sits in rank 0's rows) is refused on every rank, by name. Before, only the
ranks whose rows broke the rule raised; the others entered the documents' all-reduce and failed with "Connection
closed by peer" or waited for the group's timeout. Control: the same call with the causal mask runs on both
ranks."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.megatron.conftest import RUN_TIMEOUT

pytestmark = pytest.mark.slow  # worker processes


def worker(rank: int, world: int, prefix_lm: bool) -> str:
    torch.set_num_threads(1)
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ring import get_layout
    from megatron_ring.megatron import (RingConfig, RingDotProductAttention, destroy_context_parallel,
                                        initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        initialize_context_parallel(RingConfig(context_parallel_size=world))
        try:
            cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                                    attention_dropout=0.0, context_parallel_size=world)
            attn = RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
            S = 8
            i = torch.arange(S)
            visible = i[None, :] <= i[:, None]
            if prefix_lm:
                visible[0, 1] = True  # token 0 also sees token 1: row 0 is rank 0's only (zigzag)
            mask = ~visible[None, None]  # [1, 1, S, S], True = hidden
            pos = get_layout("zigzag").positions(S, world, rank)
            q = torch.randn(S // world, 1, 2, 8)
            try:
                attn(q, q, q, mask[:, :, pos])
                return "ran"
            except NotImplementedError as e:
                return f"NotImplementedError: {e}"
        finally:
            destroy_context_parallel(destroy_model_parallel=True)


def test_a_mask_broken_on_one_ranks_rows_is_refused_on_every_rank():
    for r in run_distributed(worker, 2, True, timeout=RUN_TIMEOUT):
        assert r.startswith("NotImplementedError: ring attention supports attention_mask tensors that are causal "
                            "within documents"), r


def test_control_the_causal_mask_runs():
    assert run_distributed(worker, 2, False, timeout=RUN_TIMEOUT) == ["ran", "ran"]
