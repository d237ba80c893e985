"""A stock-style ``pretrain_hybrid.py`` for the CI test of ``--spec megatron_ring.megatron.spec ring_hybrid_stack_spec``.

Built the way Megatron-LM's ``pretrain_hybrid.py`` (core_r0.19 / main) builds a run: ``parse_and_validate_args``
-> ``hybrid_config_from_args`` (which imports ``--spec`` as the hybrid stack spec) ->
``pretrain_cfg_container_from_args`` -> ``pretrain`` (``HybridModelBuilder``); Megatron's own
``get_batch_on_this_cp_rank`` (zigzag) and a ``pretrain_hybrid``-style loss (masked sum and token count;
Megatron's schedule does the CP scaling). Nothing from megatron_ring is called here but through ``--spec``
(and the CPU opt-in on machines without CUDA). Data: the examples' deterministic learnable token stream.

Env: ``MEGATRON_RING_LOSS_LOG``: one line per micro-batch on rank 0, loss sum and token count over DP x CP.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stock_pretrain_gpt as stock  # noqa: E402  (the same run; only the model-config builder differs)

from megatron.training.argument_utils import hybrid_config_from_args  # noqa: E402

if __name__ == "__main__":
    stock.main(hybrid_config_from_args)
