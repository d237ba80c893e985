"""Workers for the HybridModel tests (spawned gloo processes; 0.19 wheel: ``megatron.core.models.hybrid``).

Under test: Megatron's own ``HybridModel`` built from ``ring_hybrid_stack_spec`` at CP = 1, 2, 4, batches
split by Megatron's own ``get_batch_on_this_cp_rank`` (zigzag), Mamba / GDN layers through Megatron's own
CP code and the CPU opt-in's pure-torch kernels. Reference: the same model from Megatron's hybrid stack
spec without the ring (local ``DotProductAttention``) at CP = 1, one process. Same seeds, so the same
weights. Per step: the mean loss over all tokens (each CP rank's masked sum, summed over CP, over the
global token count); step-0 gradients summed over CP (parameters are replicated over CP).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.cp_step import reduce_over_cp

HYBRID = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab=128, seq=64, micro_batch=2,
              seed=1234, data_seed=11, lr=3e-3, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_conv_kernel_dim=4, num_moe_experts=4, moe_router_topk=2)


def config(m: dict, pattern: str, cp: int, attention_dropout: float = 0.0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = "E" in pattern
    kw = dict(num_moe_experts=m["num_moe_experts"], moe_router_topk=m["moe_router_topk"], moe_ffn_hidden_size=64,
              moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
              moe_grouped_gemm=False) if moe else {}
    return TransformerConfig(
        num_layers=len(pattern), hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=2 * m["hidden_size"], context_parallel_size=cp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=attention_dropout,
        params_dtype=torch.float32, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        mamba_state_dim=m["mamba_state_dim"], mamba_head_dim=m["mamba_head_dim"], mamba_num_groups=m["mamba_num_groups"],
        linear_key_head_dim=m["linear_key_head_dim"], linear_value_head_dim=m["linear_value_head_dim"],
        linear_num_key_heads=m["linear_num_key_heads"], linear_num_value_heads=m["linear_num_value_heads"],
        linear_conv_kernel_dim=m["linear_conv_kernel_dim"], **kw)


def build(m: dict, pattern: str, cp: int, ring: bool, attention_dropout: float = 0.0):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_ring.megatron.spec import ring_hybrid_stack_spec
    from megatron_ring.megatron.spec.hybrid import RingHybridStackSpec

    torch.manual_seed(m["seed"])
    spec = ring_hybrid_stack_spec if ring else RingHybridStackSpec(ring=False)
    return HybridModel(config=config(m, pattern, cp, attention_dropout), hybrid_stack_spec=spec,
                       vocab_size=m["vocab"], max_sequence_length=m["seq"], hybrid_layer_pattern=pattern,
                       position_embedding_type="rope", share_embeddings_and_output_weights=False)


def make_batch(m: dict, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(m["data_seed"] * 1000 + step)
    b, s = m["micro_batch"], m["seq"]
    data = torch.randint(0, m["vocab"], (b, s + 1), generator=g)
    return dict(tokens=data[:, :-1].contiguous(), labels=data[:, 1:].contiguous(),
                loss_mask=(torch.rand(b, s, generator=g) > 0.25).float(),
                position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous())


#: packed THD: odd real document lengths, each padded to a multiple of 2 * pack_cp (the largest CP tested),
#: so CP = 1, 2, 4 see the same stream; padding tokens carry no loss
PACKED = dict(doc_lengths=(13, 5, 22, 1, 9, 3), pack_cp=4)


def packed_layout(m: dict | None) -> tuple[list[int], list[int]]:
    """``(cu_seqlens, cu_seqlens_padded)`` of the packed stream."""
    lens = list((m or {}).get("doc_lengths", PACKED["doc_lengths"]))
    unit = 2 * (m or {}).get("pack_cp", PACKED["pack_cp"])
    padded = [-(-n // unit) * unit for n in lens]
    cu, cup = [0], [0]
    for n, p in zip(lens, padded):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + p)
    return cu, cup


def make_packed_batch(m: dict, step: int) -> dict[str, torch.Tensor]:
    """One packed THD micro-batch ``[1, T]``: each document ``n + 1`` random tokens (inputs and next-token
    labels), then filler up to its padded length (loss mask 0 there); position ids restart per document."""
    g = torch.Generator().manual_seed(m["data_seed"] * 1000 + 500 + step)
    _, cup = packed_layout(m)
    tokens, labels, mask, pos = [], [], [], []
    for n, a, b in zip(m.get("doc_lengths", PACKED["doc_lengths"]), cup[:-1], cup[1:]):
        doc = torch.randint(0, m["vocab"], (n + 1,), generator=g)
        fill = torch.randint(0, m["vocab"], (b - a - n,), generator=g)
        tokens.append(torch.cat([doc[:-1], fill]))
        labels.append(torch.cat([doc[1:], fill]))
        mask.append(torch.cat([(torch.rand(n, generator=g) > 0.25).float(), torch.zeros(b - a - n)]))
        pos.append(torch.arange(b - a))
    return {k: torch.cat(v).unsqueeze(0) for k, v in
            dict(tokens=tokens, labels=labels, loss_mask=mask, position_ids=pos).items()}


def packed_params(m: dict):
    """Megatron's ``PackedSeqParams`` of the packed stream (global cu_seqlens, qkv_format ``thd``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cup = packed_layout(m)
    cu_t, cup_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)
    width = max(b - a for a, b in zip(cup[:-1], cup[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=cup_t,
                           cu_seqlens_kv_padded=cup_t, max_seqlen_q=width, max_seqlen_kv=width,
                           total_tokens=cup[-1])  # total_tokens: Mamba's per-document seq_idx


def split_packed(batch: dict, cp_group, m: dict | None = None) -> dict:
    """This CP rank's share of a packed batch: Megatron's own per-document zigzag split
    (``_get_batch_on_this_cp_rank_per_document_balancing``, TransformerEngine's ``thd_get_partitioned_indices``;
    the pure-torch one the CPU opt-in installs where TE is missing)."""
    import megatron.core.utils as mutils

    if cp_group.size() == 1:
        return batch
    cu, cup = packed_layout(m)
    if hasattr(mutils, "get_thd_batch_on_this_cp_rank"):  # Megatron-LM main's name for it
        out, _ = mutils.get_thd_batch_on_this_cp_rank(
            dict(batch), torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32),
            torch.tensor([cup[-1]]), cp_size=cp_group.size(), cp_rank=cp_group.rank())
    else:
        out = mutils._get_batch_on_this_cp_rank_per_document_balancing(
            dict(batch, cu_seqlens=torch.tensor([cu], dtype=torch.int32),
                 cu_seqlens_padded=torch.tensor([cup], dtype=torch.int32)), cp_group)
    return {k: out[k] for k in batch}


def split(batch: dict, cp_group, how: str = "zigzag") -> dict:
    """This CP rank's share: Megatron's own zigzag split, or (negative control) contiguous chunks."""
    from megatron_ring.megatron import compat

    if cp_group.size() == 1:
        return batch
    if how == "zigzag":
        return compat.megatron_get_batch_on_this_cp_rank(dict(batch), cp_group)
    return {k: v.chunk(cp_group.size(), dim=1)[cp_group.rank()].contiguous() for k, v in batch.items()}


def hybrid_worker(rank: int, world: int, m: dict, pattern: str, ring: bool, steps: int,
                  attention_dropout: float = 0.0, how: str = "zigzag") -> dict[str, Any]:
    """Losses per step and step-0 gradients (rank 0 returns them) of HybridModel at CP = world.

    ``how``: ``zigzag`` (BSHD, Megatron's split), ``contiguous`` (BSHD, the negative control), ``thd`` (the
    packed batch, Megatron's per-document split, ``PackedSeqParams``), ``thd_stream`` (negative control: the packed
    batch split zigzag over the whole stream, as BSHD is), ``documents`` (the packed batch's real
    documents one at a time as BSHD ``[1, n]`` batches: the independent reference for ``thd``, CP = 1 only)."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    if "E" in pattern and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's MoE router gating asks for it
    with megatron_cpu():
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            model = build(m, pattern, world, ring, attention_dropout)
            cp_group = ps.get_context_parallel_group()
            opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
            losses, grads0 = [], None
            # step 0's core-attention calls (dropout 0 only: a float64 reference cannot redraw dropout's mask)
            records: list = []
            hooks = capture_core_attention(model, records) if ring and attention_dropout == 0.0 else []
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                if how == "documents":
                    local, total = _documents_step(model, make_packed_batch(m, step), m)
                else:
                    packed = how in ("thd", "thd_stream")
                    full = make_packed_batch(m, step) if packed else make_batch(m, step)
                    total = full["loss_mask"].sum()
                    if packed:  # thd_stream (negative control): the stream's zigzag split, not per document
                        mine = split_packed(full, cp_group, m) if how == "thd" else split(full, cp_group)
                        tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"],
                                    packed_seq_params=packed_params(m))
                    else:
                        mine = split(full, cp_group, how)
                        tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
                    local = (tok * mine["loss_mask"]).sum()
                    (local / total).backward()
                rep = reduce_over_cp(local, model, cp_group, world)
                losses.append(float(rep / total))
                if step == 0:
                    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                    for h in hooks:
                        h.remove()
                opt.step()
            return dict(losses=losses, grads=grads0 if rank == 0 else None, attention=records)
        finally:
            ps.destroy_model_parallel()


def capture_core_attention(model, records: list) -> list:
    """Forward hooks on the model's ``RingDotProductAttention`` modules: per call, one record in ``records`` with
    the layer's name, the ``q``, ``k``, ``v`` core attention was given on this rank (after Megatron's RoPE, in
    this rank's token order) and the ``out`` it returned; during the model's own backward, tensor hooks add the
    upstream gradient of the output (``dout``) and the gradients that flow back into q, k, v (``dq``, ``dk``,
    ``dv``). Returns the hook handles (remove them to stop capturing)."""
    from megatron_ring.megatron.attention.module import RingDotProductAttention

    def hook(module, args, kwargs, out, name):
        q, k, v = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(("query", "key", "value")))
        rec = dict(layer=name, q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(),
                   out=out.detach().clone())
        for key, t in (("dq", q), ("dk", k), ("dv", v), ("dout", out)):
            t.register_hook(lambda g, key=key, rec=rec: rec.__setitem__(key, g.detach().clone()))
        records.append(rec)

    return [mod.register_forward_hook(lambda *a, name=name: hook(*a, name), with_kwargs=True)
            for name, mod in model.named_modules() if isinstance(mod, RingDotProductAttention)]


def _documents_step(model, full: dict, m: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward / backward of the packed batch's real documents one by one (BSHD, CP = 1): the masked loss sum
    and the packed batch's token count (gradients accumulate as ``sum / total``, as the packed step's do)."""
    _, cup = packed_layout(m)
    total = full["loss_mask"].sum()
    local = torch.zeros(())
    for n, a in zip(m.get("doc_lengths", PACKED["doc_lengths"]), cup[:-1]):
        doc = {k: v[:, a:a + n] for k, v in full.items()}
        tok = model(doc["tokens"], torch.arange(n).unsqueeze(0), None, labels=doc["labels"])
        part = (tok * doc["loss_mask"]).sum()
        (part / total).backward()
        local = local + part.detach()
    return local, total


def build_error_worker(rank: int, world: int, m: dict, pattern: str, ring: bool) -> str:
    """The error (type: message) building HybridModel raises at CP = world, or 'built'."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring_lab.cpu import megatron_cpu

    with megatron_cpu():
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"])
            try:
                model = build(m, pattern, world, ring)
            except Exception as e:  # noqa: BLE001 - the test reads the message
                return f"{type(e).__name__}: {e}"
            if world > 1:  # Megatron's local attention refuses CP > 1 in its forward, if not at build time
                try:
                    b = split(make_batch(m, 0), ps.get_context_parallel_group())
                    model(b["tokens"], b["position_ids"], None, labels=b["labels"])
                except Exception as e:  # noqa: BLE001
                    return f"{type(e).__name__}: {e}"
            return "built"
        finally:
            ps.destroy_model_parallel()
