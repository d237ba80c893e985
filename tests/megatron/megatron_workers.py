"""Worker functions for the Megatron integration tests (run in spawned gloo processes).

Reference: Megatron-Core's own GPTModel with ``get_gpt_layer_local_spec`` (local DotProductAttention) at
TP = CP = 1 in a single process. Under test: the same seed and weights with ``get_gpt_layer_ring_spec``
at (TP, CP) > 1. Workers return plain Python / CPU tensors (pickled through files by the launcher).
"""
from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab=128, seq=64,
             micro_batch=2, pos_emb="rope", seed=1234, data_seed=7, lr=5e-3, data_cycle=2)


def sizes(m: dict = MODEL, dp: int = 1) -> dict:
    """The sizes the model-level tolerance needs (tests/helpers/numerics.py ``model_bounds``): FFN 2 x hidden
    (``_transformer_config``), ``dp`` x micro-batch x seq tokens per iteration."""
    return dict(seq=m["seq"], hidden=m["hidden_size"], layers=m["num_layers"], ffn=2 * m["hidden_size"],
                tokens=dp * m["micro_batch"] * m["seq"])


def _transformer_config(m: dict, tp: int, cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=2 * m["hidden_size"],
        tensor_model_parallel_size=tp, context_parallel_size=cp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True)


def _build(m: dict, tp: int, cp: int, ring: bool, layout_rope: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ring.megatron import get_gpt_layer_ring_spec, use_layout_rope

    torch.manual_seed(m["seed"])  # CPU init draws full master weights from this generator, then splits by TP
    spec = (get_gpt_layer_ring_spec if ring else get_gpt_layer_local_spec)(normalization="RMSNorm")
    model = GPTModel(_transformer_config(m, tp, cp), spec, vocab_size=m["vocab"], max_sequence_length=m["seq"],
                     position_embedding_type=m["pos_emb"])
    if ring and layout_rope:
        use_layout_rope(model)
    return model


def make_batch(m: dict, step: int, n_seqs: int) -> dict[str, torch.Tensor]:
    """A deterministic global batch ``[n_seqs, seq]`` with an irregular loss mask (``data_cycle`` distinct
    batches repeat, so a few steps visibly lower the loss)."""
    g = torch.Generator().manual_seed(m["data_seed"] * 1000 + step % m["data_cycle"])
    s = m["seq"]
    data = torch.randint(0, m["vocab"], (n_seqs, s + 1), generator=g)
    loss_mask = (torch.rand(n_seqs, s, generator=g) > 0.25).float()
    return dict(tokens=data[:, :-1].contiguous(), labels=data[:, 1:].contiguous(), loss_mask=loss_mask,
                position_ids=torch.arange(s).unsqueeze(0).expand(n_seqs, s).contiguous())


def _full_grads(model, tp_group) -> dict[str, torch.Tensor]:
    """Gradients with TP shards reassembled along each parameter's partition dimension (and stride)."""
    out = {}
    tp = dist.get_world_size(tp_group)
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            stride = getattr(p, "partition_stride", 1)  # e.g. GLU fc1: each shard is [gate_r; up_r]
            pieces = [part.chunk(stride, dim=p.partition_dim) for part in parts]
            g = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=p.partition_dim)
        out[name] = g
    return out


# ----------------------------------------------------------------------------------------------
# reference: Megatron local attention, TP = CP = 1, one process
# ----------------------------------------------------------------------------------------------
def reference_worker(rank: int, world: int, m: dict, steps: int, dp: int) -> dict[str, Any]:
    """Loss per step and step-0 gradients of Megatron's own model, DP micro-batches accumulated."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            model = _build(m, 1, 1, ring=False)
            opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
            losses, grads0 = [], None
            b = m["micro_batch"]
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                full = make_batch(m, step, dp * b)
                total = 0.0
                for d in range(dp):  # DP replicas' micro-batches; their mean losses are averaged
                    mb = {k: v[d * b:(d + 1) * b] for k, v in full.items()}
                    tok = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
                    loss = (tok * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
                    (loss / dp).backward()
                    total += float(loss) / dp
                losses.append(total)
                if step == 0:
                    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                opt.step()
            return dict(losses=losses, grads=grads0)
        finally:
            ps.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------
# ring: GPTModel with get_gpt_layer_ring_spec at (TP, CP)
# ----------------------------------------------------------------------------------------------

def train_ring(model, m: dict, steps: int) -> tuple[list[float], Any]:
    """AdamW steps of ``model`` (ring attention at CP > 1) on the layout's share of each batch: the losses
    (summed over CP, averaged over DP) and the full step-0 gradients."""
    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import allreduce_gradients, get_batch_on_this_cp_rank, reduce_loss_over_cp

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
    losses, grads0 = [], None
    b = m["micro_batch"]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        full = make_batch(m, step, dp * b)
        mine = get_batch_on_this_cp_rank({k: v[dp_rank * b:(dp_rank + 1) * b] for k, v in full.items()})
        tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
        red = reduce_loss_over_cp(tok, mine["loss_mask"])
        red.loss.backward()
        allreduce_gradients(model)
        rep = red.reported.clone()
        dist.all_reduce(rep, group=ps.get_data_parallel_group())
        losses.append(float(rep) / dp)
        if step == 0:
            grads0 = _full_grads(model, ps.get_tensor_model_parallel_group())
        opt.step()
    return losses, grads0

def ring_worker(rank: int, world: int, m: dict, tp: int, cp: int, layouts: list[str], steps: int,
                negative_control: bool = False) -> dict[str, Any]:
    """For each layout: per-step reported loss and step-0 full gradients (returned by global rank 0).

    Also returns this rank's group memberships, for the orthogonality checks.
    """
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import (ContextParallelConfigError, RingConfig, allreduce_gradients, destroy_context_parallel, get_batch_on_this_cp_rank, initialize_context_parallel, reduce_loss_over_cp)
    from megatron_ring.megatron.attention import rope_guard
    from megatron_ring_lab.cpu import megatron_cpu

    out: dict[str, Any] = {"layouts": {}}
    with megatron_cpu():
        try:
            for layout in layouts:
                state = initialize_context_parallel(RingConfig(context_parallel_size=cp, layout=layout),
                                                    tensor_model_parallel_size=tp, seq_length=m["seq"])
                tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
                model = _build(m, tp, cp, ring=True)
                dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
                b = m["micro_batch"]
                losses, grads0 = train_ring(model, m, steps)
                res: dict[str, Any] = dict(losses=losses)
                if rank == 0:
                    res["grads"] = grads0
                if negative_control:  # RoPE left on Megatron's zigzag slicing: refused, and wrong, unless zigzag
                    nc = _build(m, tp, cp, ring=True, layout_rope=False)
                    mb = get_batch_on_this_cp_rank({k: v[dp_rank * b:(dp_rank + 1) * b]
                                                    for k, v in make_batch(m, 0, dp * b).items()})
                    refused = None
                    try:
                        tok = nc(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
                    except ContextParallelConfigError as e:  # RoPE not at the layout's positions (rope_guard.py)
                        refused, check = str(e), rope_guard.check
                        rope_guard.check = lambda *a: None  # the check off: what it keeps from happening silently
                        try:
                            tok = nc(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
                        finally:
                            rope_guard.check = check
                    red = reduce_loss_over_cp(tok, mb["loss_mask"])
                    red.loss.backward()
                    allreduce_gradients(nc)
                    nc_grads = _full_grads(nc, ps.get_tensor_model_parallel_group())
                    res["negative_control"] = dict(refused=refused)  # every rank's
                    if rank == 0:
                        res["negative_control"].update(loss=float(red.reported), grads=nc_grads)
                out["layouts"][layout] = res
                destroy_context_parallel()
            out["groups"] = dict(
                rank=rank,
                cp=list(state.global_ranks), tp=dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
                pp=dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
                dp=dist.get_process_group_ranks(ps.get_data_parallel_group()),
                dpcp=dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)),
                next=state.next_rank, prev=state.prev_rank)
            return out
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------
# bad configurations: every rank must raise the same flag-naming error
# ----------------------------------------------------------------------------------------------
def bad_config_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    """Run one invalid setup; return the exception type and message this rank saw (or 'no error')."""
    torch.set_num_threads(1)
    import argparse

    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import (RingConfig, add_context_parallel_args, config_from_args, destroy_context_parallel, initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu

    def parse(argv: list[str]):
        p = argparse.ArgumentParser()
        p.add_argument("--tensor-model-parallel-size", type=int, default=1)
        p.add_argument("--seq-length", type=int, default=64)
        p.add_argument("--attention-dropout", type=float, default=0.0)
        add_context_parallel_args(p)
        return p.parse_args(argv)

    try:
        with megatron_cpu():
            try:
                if case == "cp_not_dividing_world":
                    initialize_context_parallel(config_from_args(parse(["--context-parallel-size", "3"])))
                elif case == "tp_cp_not_dividing_world":
                    cfg = config_from_args(parse(["--context-parallel-size", "2", "--tensor-model-parallel-size", "4"]))
                    initialize_context_parallel(cfg, tensor_model_parallel_size=4)
                elif case == "seq_not_divisible_zigzag":
                    config_from_args(parse(["--context-parallel-size", "2", "--seq-length", "66"]))
                elif case == "seq_not_divisible_striped":
                    config_from_args(parse(["--context-parallel-size", "2", "--seq-length", "65",
                                            "--cp-layout", "striped"]))
                elif case == "hierarchical_product":
                    config_from_args(parse(["--context-parallel-size", "2",
                                            "--hierarchical-context-parallel-sizes", "2", "2"]))
                elif case == "cp_comm_type":
                    config_from_args(parse(["--context-parallel-size", "2", "--cp-comm-type", "ulysses"]))
                elif case == "attention_dropout":
                    config_from_args(parse(["--context-parallel-size", "2", "--attention-dropout", "1.5"]))
                elif case == "layout_differs_across_ranks":
                    layout = "striped" if rank == 1 else "zigzag"
                    initialize_context_parallel(RingConfig(context_parallel_size=world, layout=layout))
                elif case == "seq_differs_across_ranks":
                    initialize_context_parallel(RingConfig(context_parallel_size=world),
                                                seq_length=64 if rank == 0 else 128)
                elif case == "mismatch_with_megatron":
                    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
                    initialize_context_parallel(RingConfig(context_parallel_size=world))
                elif case == "model_config_mismatch":
                    m = dict(MODEL)
                    initialize_context_parallel(RingConfig(context_parallel_size=2))
                    model = _build(m, 1, 1, ring=True)  # config says CP=1, the ring has 2 ranks
                    model(torch.zeros(1, 32, dtype=torch.long), torch.arange(32)[None], None)
                else:
                    raise AssertionError(case)
            finally:
                destroy_context_parallel()
                if ps.model_parallel_is_initialized():
                    ps.destroy_model_parallel()
    except Exception as e:  # noqa: BLE001 - the point of the test
        return dict(type=type(e).__name__, flag=getattr(e, "flag", None), msg=str(e))
    return dict(type="no error", flag=None, msg="")


def uninitialized_worker(rank: int, world: int) -> str:
    """initialize_context_parallel before init_process_group: returns the message (run in-process)."""
    try:
        from megatron_ring.megatron import initialize_context_parallel

        initialize_context_parallel(context_parallel_size=1)
    except RuntimeError as e:
        return str(e)
    except Exception:  # noqa: BLE001
        return traceback.format_exc()
    return "no error"


def hierarchical_worker(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """Register a CP = world ring with hierarchical sub-rings; return their global ranks, and the result of
    one all-reduce over each sub-group (sum of global ranks) to prove the groups work."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import (RingConfig, destroy_context_parallel, initialize_context_parallel)
    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        try:
            st = initialize_context_parallel(RingConfig(context_parallel_size=world,
                                                        hierarchical_context_parallel_sizes=tuple(sizes)))
            again = initialize_context_parallel(RingConfig(context_parallel_size=world,
                                                           hierarchical_context_parallel_sizes=tuple(sizes)))
            sums = []
            for g in st.hierarchical_groups:
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=g)
                sums.append(float(t))
            return dict(ranks=[list(r) for r in st.hierarchical_ranks], sums=sums, idempotent=again is st)
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()


def bad_config_all(rank: int, world: int, cases: list[str]) -> dict[str, Any]:
    """:func:`bad_config_worker` for several cases in one launch."""
    return {c: bad_config_worker(rank, world, c) for c in cases}
