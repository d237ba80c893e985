"""Workers for the comm-type equivalence tests: GPTModel with ring attention at CP > 1, one run per
``--cp-comm-type`` setting (single value or per-layer list), against Megatron's CP = 1 reference."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import megatron_workers as W


def comm_type_worker(rank: int, world: int, m: dict, cp: int, cases: list[tuple], steps: int) -> dict[str, Any]:
    """``cases``: ``(label, cp_comm_type, hierarchical sizes or None)``. Per label: losses, and (rank 0)
    step-0 gradients."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import (RingConfig, allreduce_gradients, destroy_context_parallel,
                                        get_batch_on_this_cp_rank, initialize_context_parallel, megatron_cpu,
                                        reduce_loss_over_cp)

    out: dict[str, Any] = {}
    with megatron_cpu():
        try:
            for label, comm_type, hier in cases:
                initialize_context_parallel(RingConfig(context_parallel_size=cp, layout="zigzag", cp_comm_type=comm_type,
                                                       hierarchical_context_parallel_sizes=hier),
                                            seq_length=m["seq"])
                tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
                model = W._build(m, 1, cp, ring=True)
                opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
                dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
                b = m["micro_batch"]
                losses, grads0 = [], None
                for step in range(steps):
                    opt.zero_grad(set_to_none=True)
                    full = W.make_batch(m, step, dp * b)
                    mine = get_batch_on_this_cp_rank({k: v[dp_rank * b:(dp_rank + 1) * b] for k, v in full.items()})
                    tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
                    red = reduce_loss_over_cp(tok, mine["loss_mask"])
                    red.loss.backward()
                    allreduce_gradients(model)
                    rep = red.reported.clone()
                    dist.all_reduce(rep, group=ps.get_data_parallel_group())
                    losses.append(float(rep) / dp)
                    if step == 0:
                        grads0 = W._full_grads(model, ps.get_tensor_model_parallel_group())
                    opt.step()
                out[label] = dict(losses=losses, grads=grads0 if rank == 0 else None)
                destroy_context_parallel()
            return out
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()

