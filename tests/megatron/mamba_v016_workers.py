"""Workers for ``ring_hybrid_stack_spec`` on the megatron-core 0.16 form of the hybrid stack (``MambaModel``,
``MambaStack``, ``mamba_stack_spec``, ``--hybrid-override-pattern``; Megatron-LM core_v0.16.1's
``pretrain_mamba.py`` builds exactly this model from ``--spec``).

Run as a program (``python -m tests.megatron.mamba_v016_workers OUT PATTERN CP...``) in an interpreter whose
``megatron.core`` is that form: the test starts it with the 0.16 ``megatron/core`` first on ``PYTHONPATH``
(test_mamba_v016.py), because a process that has imported another megatron-core cannot switch. It writes
``OUT`` (``torch.save``): which megatron-core ran, the modules each model got, and per CP size the losses
per step and the step-0 gradients; the test compares them.

Under test: ``MambaModel(mamba_stack_spec=ring_hybrid_stack_spec)`` at CP = 1, 2, 4, batches split by
Megatron's own ``get_batch_on_this_cp_rank`` (zigzag), Mamba layers through Megatron's own CP code
(``mamba_context_parallel.py``) and the CPU opt-in's pure-torch kernels. Reference: the same model with
Megatron's own attention (``reference_hybrid_stack_spec``: local ``DotProductAttention``) at CP = 1. Same
seeds, so the same weights. Per step: the mean loss over all tokens (each CP rank's masked sum, summed over
CP, over the global token count); step-0 gradients summed over CP (parameters are replicated over CP).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.cp_step import reduce_over_cp
from tests.megatron.hybrid_workers import make_batch  # the same deterministic batch (no Megatron import)

MODEL = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab=128, seq=64, micro_batch=2,
             seed=1234, data_seed=11, lr=3e-3, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
STEPS = 2


def config(m: dict, pattern: str, cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=len(pattern), hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=2 * m["hidden_size"], context_parallel_size=cp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        mamba_state_dim=m["mamba_state_dim"], mamba_head_dim=m["mamba_head_dim"],
        mamba_num_groups=m["mamba_num_groups"])


def build(m: dict, pattern: str, cp: int, ring: bool):
    """``MambaModel`` as core_v0.16.1's ``mamba_builders.mamba_builder`` builds it from ``--spec``."""
    from megatron.core.models.mamba import MambaModel

    from megatron_ring.megatron.spec import ring_hybrid_stack_spec
    from megatron_ring.megatron.spec.hybrid import reference_hybrid_stack_spec

    torch.manual_seed(m["seed"])
    return MambaModel(config=config(m, pattern, cp), mamba_stack_spec=ring_hybrid_stack_spec if ring else
                      reference_hybrid_stack_spec, vocab_size=m["vocab"], max_sequence_length=m["seq"],
                      hybrid_override_pattern=pattern, position_embedding_type="rope",
                      share_embeddings_and_output_weights=False)


def mamba_worker(rank: int, world: int, m: dict, pattern: str, ring: bool, steps: int) -> dict[str, Any]:
    """Losses per step, step-0 gradients and the model's modules (rank 0 returns them) at CP = world."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import compat
    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            model = build(m, pattern, world, ring)
            cp_group = ps.get_context_parallel_group()
            opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
            losses, grads0 = [], None
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                full = make_batch(m, step)
                total = full["loss_mask"].sum()
                mine = full if world == 1 else compat.megatron_get_batch_on_this_cp_rank(dict(full), cp_group)
                tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
                local = (tok * mine["loss_mask"]).sum()
                (local / total).backward()
                rep = reduce_over_cp(local, model, cp_group, world)
                losses.append(float(rep / total))
                if step == 0:
                    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                opt.step()
            modules = [(n, type(x).__name__) for n, x in model.named_modules() if ".core_attention." not in n]
            return dict(losses=losses, grads=grads0, modules=modules) if rank == 0 else {}
        finally:
            ps.destroy_model_parallel()


def main(out: str, pattern: str, cps: list[int]) -> None:
    import megatron.core
    from megatron.core import package_info

    from megatron_ring.megatron import compat
    from tests.helpers.launch import TIMEOUT_S, run_distributed

    stack = compat.hybrid_stack_class()
    result: dict[str, Any] = dict(
        megatron_core=os.path.dirname(megatron.core.__file__), version=package_info.__version__,
        stack=getattr(stack, "__name__", None), reference=run_distributed(mamba_worker, 1, MODEL, pattern, False,
                                                                          STEPS, timeout=TIMEOUT_S)[0])
    for cp in cps:
        result[cp] = run_distributed(mamba_worker, cp, MODEL, pattern, True, STEPS, timeout=TIMEOUT_S)[0]
    if any(cp > 1 for cp in cps):  # the control: the reference spec (Megatron's local attention) at CP = 2
        try:
            run_distributed(mamba_worker, 2, MODEL, pattern, False, 1, timeout=TIMEOUT_S)
            result["control"] = "ran"
        except Exception as e:  # WorkerError carrying the rank's traceback
            result["control"] = str(e)
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]])
