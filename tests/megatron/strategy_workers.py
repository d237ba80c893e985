"""Workers for the comm-type equivalence tests: GPTModel with ring attention at CP > 1, one run per
``--cp-comm-type`` setting (single value or per-layer list), against Megatron's CP = 1 reference."""
from __future__ import annotations

from typing import Any

import torch

from tests.megatron import megatron_workers as W


def comm_type_worker(rank: int, world: int, m: dict, cp: int, cases: list[tuple], steps: int) -> dict[str, Any]:
    """``cases``: ``(label, cp_comm_type, hierarchical sizes or None)``. Per label: losses, and (rank 0)
    step-0 gradients."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import (RingConfig, destroy_context_parallel, initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu

    out: dict[str, Any] = {}
    with megatron_cpu():
        try:
            for label, comm_type, hier in cases:
                initialize_context_parallel(RingConfig(context_parallel_size=cp, layout="zigzag", cp_comm_type=comm_type,
                                                       hierarchical_context_parallel_sizes=hier),
                                            seq_length=m["seq"])
                tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
                model = W._build(m, 1, cp, ring=True)
                losses, grads0 = W.train_ring(model, m, steps)
                out[label] = dict(losses=losses, grads=grads0 if rank == 0 else None)
                destroy_context_parallel()
            return out
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()

