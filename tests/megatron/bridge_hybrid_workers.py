"""Workers for tests/megatron/test_bridge_hybrid.py: Megatron-Bridge's ``HybridModelProvider`` with the one line
``provider.hybrid_stack_spec = ring_hybrid_stack_spec`` (Bridge's default is megatron-core's TransformerEngine
spec, which cannot be built here), ``provide()`` at CP = world, one forward/backward on Megatron's zigzag
split. Reference: the same provider with ``reference_hybrid_stack_spec`` at CP = 1."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.cp_step import reduce_over_cp
from tests.megatron import hybrid_workers as HW


def bridge_hybrid_worker(rank: int, world: int, pattern: str, ring: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    from tests.megatron.bridge_import import import_bridge

    import_bridge("megatron.bridge.models.hybrid.hybrid_provider")
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ring_lab.cpu import megatron_cpu
    from megatron_ring.megatron.spec import ring_hybrid_stack_spec
    from megatron_ring.megatron.spec.hybrid import reference_hybrid_stack_spec

    m = HW.HYBRID
    with megatron_cpu():
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            p = HybridModelProvider(
                hybrid_layer_pattern=pattern, hidden_size=m["hidden_size"], ffn_hidden_size=2 * m["hidden_size"],
                num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
                seq_length=m["seq"], vocab_size=m["vocab"], position_embedding_type="rope", gated_linear_unit=True,
                activation_func=F.silu, mamba_state_dim=m["mamba_state_dim"], mamba_head_dim=m["mamba_head_dim"],
                mamba_num_groups=m["mamba_num_groups"], params_dtype=torch.float32, bf16=False,
                context_parallel_size=world, use_cpu_initialization=True, apply_rope_fusion=False,
                bias_dropout_fusion=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
                masked_softmax_fusion=False, cross_entropy_loss_fusion=False, persist_layer_norm=False,
                make_vocab_size_divisible_by=64, share_embeddings_and_output_weights=False,
                hybrid_stack_spec=ring_hybrid_stack_spec if ring else reference_hybrid_stack_spec)
            p.finalize()
            p._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            torch.manual_seed(m["seed"])
            model = p.provide()
            cp_group = ps.get_context_parallel_group()
            full = HW.make_batch(m, 0)
            mine = HW.split(full, cp_group)
            tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
            local = (tok * mine["loss_mask"]).sum()
            total = full["loss_mask"].sum()
            (local / total).backward()
            rep = reduce_over_cp(local, model, cp_group, world)
            grads = {n: prm.grad.detach().clone() for n, prm in model.named_parameters() if prm.grad is not None}
            return dict(loss=float(rep / total), grads=grads if rank == 0 else None)
        finally:
            ps.destroy_model_parallel()
