"""Workers for tests/megatron/test_bridge.py: a tiny Llama-style model built by Megatron-Bridge's
``GPTModelProvider``, one training step's loss and gradients through Bridge's own ``gpt_step.forward_step``.

What Bridge does and what the worker does:

* model: ``provider.provide_distributed_model(ddp_config, pg_collection=...)`` (Bridge's ``get_model``:
  ``provide()``, Megatron DDP wrap); Llama-style = RMSNorm, SwiGLU, RoPE, GQA, no biases, untied
  embeddings; ``transformer_layer_spec = local_layer_spec`` (Bridge's own local spec function: no
  TransformerEngine here). Ring attention: the one line
  ``provider.transformer_layer_spec = ring_spec(provider.transformer_layer_spec)``;
* process groups: ``use_decentralized_pg`` on = Bridge's own ``initialize._create_pg_collection`` (a
  HyperCommGrid, no ``parallel_state``; Bridge's ``_initialize_distributed`` refuses that path without
  CUDA devices, so the worker calls the function it calls); off = ``parallel_state.initialize_model_parallel``
  and ``provide_distributed_model(pg_collection=None)`` (Bridge's MPU path);
* step: Megatron-Core's ``get_forward_backward_func`` with Bridge's ``gpt_step.forward_step`` (Bridge's
  batch fetch, Megatron's zigzag CP split ``get_batch_on_this_cp_rank``, Bridge's
  ``masked_next_token_loss``) and ``finalize_model_grads`` bound to the pg collection, as Bridge's
  ``setup`` / ``train_step`` do; per-token loss (``calculate_per_token_loss``) so CP=1 and CP=2 mean the
  same thing.

The whole run sits inside megatron_ring's CPU opt-in (``megatron_training_cpu``) and gloo.
"""
from __future__ import annotations

import contextlib
import traceback
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab=128, seq=64, micro_batch=2, seed=1234, data_seed=7)


def _batch(m: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(m["data_seed"])
    b, s = m["micro_batch"], m["seq"]
    data = torch.randint(0, m["vocab"], (b, s + 1), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) > 0.25).float()
    return dict(tokens=data[:, :-1].contiguous(), labels=data[:, 1:].contiguous(), loss_mask=loss_mask,
                position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous(), attention_mask=None)


def _provider(m: dict, cp: int, variant: str):
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec

    extra: dict[str, Any] = {}
    if variant == "moe":
        extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall",
                     moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_grouped_gemm=False)
    elif variant == "mtp":
        extra = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    p = GPTModelProvider(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        kv_channels=m["hidden_size"] // m["num_attention_heads"], seq_length=m["seq"], vocab_size=m["vocab"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, position_embedding_type="rope",
        add_bias_linear=False, share_embeddings_and_output_weights=False, context_parallel_size=cp,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, bf16=False, fp16=False,
        transformer_layer_spec=local_layer_spec, calculate_per_token_loss=True,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=True, **extra)
    return p


def _state(provider, decentralized: bool):
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
        OptimizerConfig, SchedulerConfig, TokenizerConfig, TrainingConfig)
    from megatron.bridge.training.state import GlobalState

    cfg = ConfigContainer(
        train=TrainingConfig(micro_batch_size=MODEL["micro_batch"], global_batch_size=MODEL["micro_batch"],
                             train_iters=1),
        model=provider, optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=False),
        scheduler=SchedulerConfig(), logger=LoggerConfig(), checkpoint=CheckpointConfig(),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=MODEL["vocab"]),
        dataset=MockGPTDatasetConfig(random_seed=1, seq_length=MODEL["seq"], reset_position_ids=False,
                                     reset_attention_mask=False, eod_mask_loss=False),
        dist=DistributedInitConfig(use_decentralized_pg=decentralized, distributed_backend="gloo"))
    state = GlobalState()
    state.cfg = cfg
    return state


@contextlib.contextmanager
def gloo_for_nccl_groups() -> Iterator[None]:
    """CPU-lab measure: Bridge's ``_create_pg_collection`` (initialize.py) asks for ``backend="nccl"`` in
    writing (its ``HyperCommGrid`` and the embedding groups); on CPU the same groups are made with gloo.
    Scoped to the ``with`` block: ``torch.distributed``'s ``new_group`` (which ``new_subgroups_by_enumeration``
    and ``HyperCommGrid.create_pg`` call) maps ``"nccl"`` to ``"gloo"`` and is put back after."""
    from torch.distributed import distributed_c10d as c10d

    orig = c10d.new_group

    def new_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        return orig(*args, backend="gloo" if backend == "nccl" else backend, **kwargs)

    c10d.new_group, dist.new_group = new_group, new_group
    try:
        yield
    finally:
        c10d.new_group, dist.new_group = orig, orig


def bridge_worker(rank: int, world: int, cp: int, ring: bool, decentralized: bool, variant: str) -> dict[str, Any]:
    try:
        return _bridge_worker(rank, world, cp, ring, decentralized, variant)
    except Exception:
        raise RuntimeError(traceback.format_exc())


def _bridge_worker(rank: int, world: int, cp: int, ring: bool, decentralized: bool, variant: str) -> dict[str, Any]:
    from tests.megatron.bridge_import import check_no_transformer_engine, import_bridge

    import_bridge("megatron.bridge.models.gpt_provider", "megatron.bridge.training.gpt_step",
                  "megatron.bridge.training.initialize")
    from megatron.bridge.training import gpt_step
    from megatron.bridge.training.initialize import _create_pg_collection
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ring.megatron.spec import ring_spec
    from megatron_ring_lab.cpu.training import megatron_training_cpu

    m = MODEL
    with megatron_training_cpu():
        provider = _provider(m, cp, variant)
        if ring:
            provider.transformer_layer_spec = ring_spec(provider.transformer_layer_spec)  # the one line
        provider.finalize()
        state = _state(provider, decentralized)
        if decentralized:
            parallel_state._set_global_memory_buffer()
            with gloo_for_nccl_groups():
                pg = _create_pg_collection(provider, num_distributed_optimizer_instances=1)
            assert not parallel_state.model_parallel_is_initialized()
        else:
            parallel_state.initialize_model_parallel(context_parallel_size=cp)
            pg = None
        if pg is None:
            model_parallel_cuda_manual_seed(m["seed"])
        else:  # as Bridge's initialize._set_random_seed does with a pg collection
            model_parallel_cuda_manual_seed(m["seed"], tp_rank=pg.tp.rank(), ep_rank=pg.ep.rank(),
                                            etp_rank=pg.expt_tp.rank())
        torch.manual_seed(m["seed"])
        model = provider.provide_distributed_model(
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False),
            use_cpu_initialization=True, pg_collection=pg, wrap_with_ddp=True)
        pg = pg if pg is not None else provider._pg_collection
        cores: dict[str, int] = {}
        for name, mod in model[0].named_modules():
            if name.endswith("core_attention"):
                cores[type(mod).__name__] = cores.get(type(mod).__name__, 0) + 1
        config = model[0].config
        config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg)
        for chunk in model:
            chunk.zero_grad_buffer()
        fwd_bwd = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=None)
        losses = fwd_bwd(forward_step_func=partial(gpt_step.forward_step, state), data_iterator=iter([_batch(m)]),
                         model=model, num_microbatches=1, seq_length=m["seq"], micro_batch_size=m["micro_batch"],
                         decoder_seq_length=m["seq"], forward_only=False, pg_collection=pg)
        val = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        dist.all_reduce(val, group=pg.dp_cp)
        grads = {n: p.main_grad.detach().clone() for n, p in model[0].module.named_parameters()}
        out = dict(loss=float(val[0] / val[1]), tokens=int(val[1]), grads=grads, cores=cores,
                   cp_group=dist.get_world_size(pg.cp), mpu=parallel_state.model_parallel_is_initialized())
    check_no_transformer_engine()
    return out


def stand_in_worker(rank: int, world: int) -> dict[str, Any]:
    """The TransformerEngine stand-in behind Bridge's LoRA import: not importable by anyone else, and
    every use of it raises."""
    import sys

    from tests.megatron.bridge_import import TransformerEngineStandInUsed, have_transformer_engine, import_bridge

    if have_transformer_engine():
        return dict(te_import="real TransformerEngine installed", uses=["n/a"] * 4)
    import_bridge("megatron.bridge.peft.lora_layers")
    te = sys.modules["megatron.bridge.peft.lora_layers"].te
    try:
        import transformer_engine  # noqa: F401
        te_import = "imported"
    except ImportError:
        te_import = "ImportError"
    def subclass() -> None:
        class Sub(te.Linear):  # type: ignore[misc, name-defined]
            pass

    uses = []
    for use in (lambda: te.Linear(4, 4), lambda: isinstance(torch.nn.Linear(2, 2), te.Linear),
                lambda: bool(te.ops.Sequential), lambda: te.fp8_autocast(enabled=False), subclass):
        try:
            use()
            uses.append("ran")
        except TransformerEngineStandInUsed:
            uses.append("TransformerEngineStandInUsed")
        except Exception as e:  # noqa: BLE001
            uses.append(type(e).__name__)
    return dict(te_import=te_import, uses=uses)
