"""Worker for tests/megatron/test_sinks_pretrain.py: the stock-style pretrain_gpt.py mirror
(tests/megatron/stock_pretrain_gpt.py, unchanged: Megatron's own ``pretrain()``, the ring through ``--spec``)
with two test-only additions, so the mirror itself stays stock:

* ``MEGATRON_RING_SINKS_LOG=PATH``: at every forward step, before the model runs, this rank appends one JSON
  line ``[tp_rank, tp_size, offsets]`` to ``PATH.rank<global rank>``, ``offsets`` being every layer's learnable
  ``softmax_offset`` (this TP rank's heads, layer order, as Python floats: exact for fp32);
* ``MEGATRON_RING_TEST_REPLICATED_SINKS=1`` (the negative control): ``RingDotProductAttention`` checkpointed by
  ``MegatronModule``'s default ``sharded_state_dict`` (the offset treated as replicated over TP).

``torchrun ... sinks_pretrain_worker.py <stock_pretrain_gpt.py's arguments>``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stock_pretrain_gpt as mirror  # noqa: E402

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

_stock_forward_step = mirror.forward_step


def forward_step(data_iterator, model):
    log = os.environ.get("MEGATRON_RING_SINKS_LOG")
    if log:
        offsets = [p.tolist() for name, p in model.named_parameters() if name.endswith("softmax_offset")]
        line = [ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), offsets]
        with open(f"{log}.rank{dist.get_rank()}", "a") as f:
            f.write(json.dumps(line) + "\n")
    return _stock_forward_step(data_iterator, model)


if __name__ == "__main__":
    if os.environ.get("MEGATRON_RING_TEST_REPLICATED_SINKS") == "1":
        from megatron.core.transformer.module import MegatronModule

        from megatron_ring.megatron import RingDotProductAttention

        RingDotProductAttention.sharded_state_dict = MegatronModule.sharded_state_dict
    mirror.forward_step = forward_step  # main() passes the module's forward_step to pretrain()
    mirror.main()
