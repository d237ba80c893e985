"""Workers for the Megatron MLA / attention-sink / attention-dropout equivalence tests.

Reference (one process, TP = CP = 1): Megatron-Core's own ``DotProductAttention`` as the core attention
(``softmax_type`` off-by-one / learnable via its ``SoftmaxOne``; for MLA a thin subclass that accepts the
``k_channels``/``v_channels`` that ``MLASelfAttention`` passes — 0.16.1's class does not — and sizes its
output by V's head dim). For attention dropout the reference is the ring spec at CP = 1 with the same
seed (Megatron's own dropout draws a different mask by construction). Under test: the ring spec at CP > 1.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from tests.megatron import megatron_workers as W

BASE = dict(W.MODEL, seq=32, num_layers=2)
CASES = ("mla", "sink_off_by_one", "sink_learnable", "mla_sink_dropout", "dropout")


def _config(case: str, cp: int):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    m = BASE
    kw: dict[str, Any] = dict(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        ffn_hidden_size=2 * m["hidden_size"], tensor_model_parallel_size=1, context_parallel_size=cp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True)
    if "sink_off" in case:
        kw["softmax_type"] = "off-by-one"
    if "sink_learn" in case or case == "mla_sink_dropout":
        kw["softmax_type"] = "learnable"
    if "dropout" in case:
        kw["attention_dropout"] = 0.2
    if case.startswith("mla"):
        return MLATransformerConfig(**kw, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32,
                                    qk_head_dim=24, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope",
                                    rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)
    return TransformerConfig(**kw, num_query_groups=m["num_query_groups"])


def _reference_core():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MegatronCoreAttention(DotProductAttention):
        """Megatron's DotProductAttention; accepts MLA's k/v channel sizes; built on CPU."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MegatronCoreAttention


@contextlib.contextmanager
def _cuda_device_is_cpu():
    """CPU-only gaps of 0.16.1 when building: DotProductAttention's softmax_offset and MLA's RotaryEmbedding
    use torch.cuda.current_device(); MLA checks isinstance(.., TELinear) whenever TE's import 'worked'."""
    from megatron.core.transformer import multi_latent_attention as mla

    orig, have_te = torch.cuda.current_device, mla.HAVE_TE
    torch.cuda.current_device = lambda: "cpu"
    mla.HAVE_TE = False  # without TE its TELinear is a mock that isinstance() rejects
    try:
        yield
    finally:
        torch.cuda.current_device, mla.HAVE_TE = orig, have_te


def _build(case: str, cp: int, ring: bool, layout: str = "zigzag"):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ring.megatron import get_gpt_layer_ring_spec, use_layout_rope

    mla = case.startswith("mla")
    torch.manual_seed(BASE["seed"])
    if ring:
        spec = get_gpt_layer_ring_spec(normalization="RMSNorm", multi_latent_attention=mla)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", multi_latent_attention=mla)
        spec.submodules.self_attention.submodules.core_attention = _reference_core()
    with _cuda_device_is_cpu():  # MLA's RotaryEmbedding is built on torch.cuda.current_device() (CPU here)
        model = GPTModel(_config(case, cp), spec, vocab_size=BASE["vocab"], max_sequence_length=BASE["seq"],
                         position_embedding_type="none" if mla else "rope")
    if ring and cp > 1:
        use_layout_rope(model, layout)
    return model


def _step(model, batch, shard, reduce):
    tok = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss, reported = reduce(tok, batch["loss_mask"])
    loss.backward()
    return reported


def reference_worker(rank: int, world: int, steps: int) -> dict:
    """Per case: losses and step-0 gradients at TP = CP = 1 (Megatron's attention; ring for dropout)."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    out = {}
    with megatron_cpu():
        ps.initialize_model_parallel(1, 1)
        try:
            for case in CASES:
                tensor_parallel.model_parallel_cuda_manual_seed(BASE["seed"], force_reset_rng=True)
                model = _build(case, 1, ring="dropout" in case)
                model.train()
                out[case] = _train(model, steps, lambda b: b, _local_loss, None)
        finally:
            ps.destroy_model_parallel()
    return out


def _local_loss(tok, mask):
    loss = (tok * mask).sum() / mask.sum()
    return loss, float(loss)


def _train(model, steps, shard, reduce, grads_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=BASE["lr"], weight_decay=0.0)
    b = BASE["micro_batch"]
    losses, grads0 = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        batch = shard(W.make_batch(BASE, step, b))
        losses.append(_step(model, batch, shard, reduce))
        if grads_fn is not None:
            grads_fn(model)
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return dict(losses=losses, grads=grads0)


def ring_worker(rank: int, world: int, layouts: list[str], steps: int, cases=CASES) -> dict:
    """Per (case, layout) at CP = world: reported losses and step-0 gradients (summed over CP)."""
    torch.set_num_threads(1)
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import (RingConfig, allreduce_gradients, destroy_context_parallel, get_batch_on_this_cp_rank, initialize_context_parallel, reduce_loss_over_cp)
    from megatron_ring_lab.cpu import megatron_cpu

    def reduce(tok, mask):
        red = reduce_loss_over_cp(tok, mask)
        return red.loss, float(red.reported)

    out = {}
    with megatron_cpu():
        try:
            for layout in layouts:
                initialize_context_parallel(RingConfig(context_parallel_size=world, layout=layout),
                                            seq_length=BASE["seq"])
                for case in cases:
                    tensor_parallel.model_parallel_cuda_manual_seed(BASE["seed"], force_reset_rng=True)
                    model = _build(case, world, ring=True, layout=layout)
                    model.train()
                    out[(case, layout)] = _train(model, steps, get_batch_on_this_cp_rank, reduce,
                                                 allreduce_gradients)
                destroy_context_parallel()
        finally:
            destroy_context_parallel()
            from megatron.core import parallel_state as ps
            ps.destroy_model_parallel()
    return out if rank == 0 else {}


def eval_worker(rank: int, world: int) -> dict:
    """Outputs of the dropout model: train vs eval mode, and two train-mode calls."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1)
        try:
            batch = W.make_batch(BASE, 0, 2)
            tensor_parallel.model_parallel_cuda_manual_seed(BASE["seed"], force_reset_rng=True)
            model = _build("dropout", 1, ring=True)
            outs = []
            for train in (True, True, False, False):
                model.train(train)
                with torch.no_grad():
                    outs.append(model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]))
            return dict(train_vs_eval=not torch.allclose(outs[0], outs[2]),
                        train_vs_train=not torch.allclose(outs[0], outs[1]),
                        eval_vs_eval=torch.equal(outs[2], outs[3]))
        finally:
            ps.destroy_model_parallel()
