"""Megatron-LM's own training loop (``megatron.training.pretrain``) with ring-attention context parallelism.

    # CPU / gloo (the scoped CPU opt-in is used automatically when CUDA is absent):
    torchrun --nproc-per-node 4 examples/pretrain_ring_gpt.py --context-parallel-size 4 --cp-layout zigzag \\
        --distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion \\
        --transformer-impl local --rerun-mode disabled <model and training flags>
    # GPUs: the same script and flags without the four CPU ones.

Everything is Megatron's: argument parser (plus megatron_ring's ``--cp-layout`` / ``--cp-comm-dtype``
through ``extra_args_provider``, added only when Megatron lacks them), ``initialize_megatron``, DDP or the
distributed optimizer, the schedule, recompute, logging. This file supplies the three callbacks:

* ``model_provider``: ``GPTModel`` with ring attention in its layer spec when ``--context-parallel-size``
  > 1 (the ring registered on Megatron's own CP groups) and RoPE following ``--cp-layout``; at CP = 1
  Megatron's own local attention (the reference);
* ``forward_step``: the batch split by the configured layout, a CP-aware loss (exact at any CP size);
* ``train_valid_test_datasets_provider``: a deterministic learnable token stream (no download).

``--hybrid-context-parallel --calculate-per-token-loss --max-seqlen-per-dp-cp-rank N`` runs Megatron's own
hybrid-CP loop with the ring: samples carry three documents each (``cu_seqlens``), Megatron's data wrapper
and scheduler give each document a group of DP x CP ranks, and ``forward_step`` runs it on that group
(:func:`megatron_ring.megatron.get_hybrid_cp_batch`). ``--ring-cp-scheduler`` swaps our
scheduler in for Megatron's. ``--documents`` runs the same documents at a fixed CP size (the reference:
document-masked attention, RoPE per document; at CP = 1 one document per call through Megatron's local
attention). See docs/dynamic_cp.md.

``--dynamic-cp`` (with ``--dynamic-cp-mix long-tail|uniform`` or ``--dynamic-cp-lengths FILE``) prints, per
global batch for the first ``--dynamic-cp-batches`` ones, the schedule of our dynamic-CP scheduler vs
Megatron's hybrid-CP policy vs fixed CP sizes (predicted; see docs/dynamic_cp.md). It plans only.

Needs ``megatron.training`` (shipped in the megatron-core wheel from 0.19, or a Megatron-LM checkout on
PYTHONPATH). ``--attention-backend local`` would mean Megatron's attention: it is refused at CP > 1.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from functools import partial

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it for TP/CP > 1 (GPU stream order)
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope|absl|transformer-engine|"
                                          "moe_ffn_hidden_size|ModelConfig).*")
try:  # run from a checkout without installing
    import megatron_ring  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402

from megatron_ring.megatron import (add_context_parallel_args, config_from_args, get_batch_on_this_cp_rank, get_hybrid_cp_batch, get_gpt_layer_ring_spec, initialize_context_parallel, is_context_parallel_initialized, use_layout_rope)  # noqa: E402
from megatron_ring.megatron import compat  # noqa: E402
from megatron_ring.megatron.spec.megatron_lm import check_attention_backend, uses_ring_attention  # noqa: E402
from megatron_ring_lab.cpu.training import megatron_training_cpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pattern_data import PatternDataset  # noqa: E402


#: ring attention at every CP size, CP = 1 included (examples/pretrain_ring_gpt_any_cp.py sets it); otherwise
#: Megatron's own attention at CP = 1, the reference of the parity tests
RING_AT_EVERY_CP_SIZE = False


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    ring = RING_AT_EVERY_CP_SIZE or uses_ring_attention(args)
    if config is None:
        config = core_transformer_config_from_args(args)
    if ring:
        check_attention_backend(args)  # --attention-backend local would mean Megatron's attention
        # registers the ring on Megatron's CP groups (idempotent); validates --cp-* against the world
        initialize_context_parallel(config_from_args(args), seq_length=args.seq_length)
        spec = get_gpt_layer_ring_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    else:
        spec = compat.gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    kwargs = dict(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, fp16_lm_cross_entropy=False,
                     parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base, **kwargs)
    if ring:
        use_layout_rope(model)  # RoPE positions follow --cp-layout
    return model


HYBRID_DOCS = "--hybrid-context-parallel" in sys.argv or "--documents" in sys.argv  # samples carry cu_seqlens


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    plan_dynamic_cp(args)
    vocab = args.vocab_size or args.padded_vocab_size
    return tuple(PatternDataset(max(int(n), 1), args.seq_length, vocab, args.seed + k, documents=HYBRID_DOCS)
                 for k, n in enumerate(num_samples))


train_valid_test_datasets_provider.is_distributed = True  # every rank reads its own (identical) copy


def get_batch(data_iterator):
    batch = next(data_iterator)
    batch = {k: v.to(torch.cuda.current_device()) if torch.cuda.is_available() else v for k, v in batch.items()}
    if is_context_parallel_initialized():
        return get_batch_on_this_cp_rank(batch)  # split with --cp-layout
    return compat.megatron_get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())


def loss_func(loss_mask, output_tensor, group_size=None):
    """CP-aware: Megatron divides each rank's loss by its own token count and averages gradients over
    DP x CP; scaling by (local tokens x CP / CP-group tokens) makes that the exact full-sequence mean.
    With --calculate-per-token-loss Megatron divides by the global token count itself: no scaling."""
    args = get_args()
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    cp = args.context_parallel_size
    if cp > 1 and not args.calculate_per_token_loss:
        group_tokens = mask.sum().detach().clone()
        dist.all_reduce(group_tokens, group=ps.get_context_parallel_group())
        loss = loss * (mask.sum() * cp / group_tokens.clamp(min=1))
    if HYBRID_DOCS:  # ranks run different numbers of micro-batches: no collective here, one file per rank
        _log_local_loss(torch.sum(losses * mask).detach(), mask.sum(), args.curr_iteration,
                        group_size or args.context_parallel_size)
    else:
        _log_loss(loss.detach() if cp == 1 or args.calculate_per_token_loss else torch.sum(losses * mask).detach(),
                  mask.sum())
    return loss, num_tokens, report


LOSS_LOG = os.environ.get("MEGATRON_RING_LOSS_LOG")  # full-precision losses for tests / the demo


def _log_loss(loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
    """With MEGATRON_RING_LOSS_LOG set: one line per micro-batch on global rank 0 with the loss sum and
    token count over DP x CP (float64), and the time."""
    if not LOSS_LOG:
        return
    import time

    stats = torch.stack([loss_sum.double(), tokens.double()])
    dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
    if dist.get_rank() == 0:
        with open(LOSS_LOG, "a") as f:
            f.write(f"{stats[0].item():.17g} {stats[1].item():.17g} {time.time():.6f}\n")


def _log_local_loss(loss_sum: torch.Tensor, tokens: torch.Tensor, iteration: int, group_size: int) -> None:
    """Documents mode: each rank appends ``iteration loss_sum tokens group_size`` of its own tokens (and the
    CP size the call ran on) to LOSS_LOG.rank<r>; sum the files per iteration for the global batch."""
    if LOSS_LOG and ps.get_tensor_model_parallel_rank() == 0:  # TP peers hold the same loss
        with open(f"{LOSS_LOG}.rank{dist.get_rank()}", "a") as f:
            f.write(f"{iteration} {loss_sum.double().item():.17g} {tokens.double().item():.17g} {group_size}\n")


def _log_peak_memory() -> None:
    if LOSS_LOG:
        import resource

        with open(f"{LOSS_LOG}.mem{dist.get_rank()}", "w") as f:
            f.write(f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}\n")


def forward_step(data_iterator, model):
    args = get_args()
    _dump_weights(model, args)
    if args.hybrid_context_parallel:  # one document per call, on the group of local_cp_size ranks
        sample = next(data_iterator) if data_iterator is not None else None  # None: TP rank > 0
        batch, packed = get_hybrid_cp_batch(sample, layout=args.cp_layout)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
        return output, partial(loss_func, batch["loss_mask"], group_size=packed.local_cp_size)
    if HYBRID_DOCS:  # --documents: the same documents at a fixed CP size (the reference of the hybrid loop)
        return _forward_documents(data_iterator, model, args)
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _forward_documents(data_iterator, model, args):
    """Fixed CP with document masking: at CP > 1 each sample is one packed THD stream on the fixed CP group
    (ring attention within documents, RoPE positions per document); at CP = 1 each document is its own
    causal sequence through Megatron's local attention (an independent path)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = next(data_iterator)
    if args.micro_batch_size != 1:
        raise SystemExit("--documents needs --micro-batch-size 1 (one packed sample per micro-batch)")
    cu = batch.pop("cu_seqlens").view(-1).to(torch.int32)
    if args.context_parallel_size > 1:
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int((cu[1:] - cu[:-1]).max()), max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
        batch["position_ids"] = torch.arange(cu[-1].item()).view(1, -1)
        batch = get_batch_on_this_cp_rank(batch)  # the stream split by --cp-layout; cu_seqlens stay global
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
        return output, partial(loss_func, batch["loss_mask"])
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        pos = torch.arange(b - a).view(1, -1)
        outs.append(model(batch["tokens"][:, a:b], pos, None, labels=batch["labels"][:, a:b]))
    return torch.cat(outs, dim=1), partial(loss_func, batch["loss_mask"])


WEIGHTS_DUMP = os.environ.get("MEGATRON_RING_WEIGHTS_DUMP")  # tests: the weights at the start of each iteration
_dumped: set = set()


def _dump_weights(model, args) -> None:
    """With MEGATRON_RING_WEIGHTS_DUMP=PREFIX: global rank 0 saves every parameter (float64) to
    PREFIX.it<k>.pt at the first forward of iteration k (the weights after k optimizer steps)."""
    it = args.curr_iteration
    if not WEIGHTS_DUMP or it in _dumped:
        return
    _dumped.add(it)
    if dist.get_rank() == 0:
        torch.save({n: p.detach().double().cpu().clone() for n, p in model.named_parameters()},
                   f"{WEIGHTS_DUMP}.it{it}.pt")


def add_args(parser):
    parser = add_context_parallel_args(parser)
    group = parser.add_argument_group("dynamic context parallelism (megatron_ring, planning)")
    group.add_argument("--dynamic-cp", action="store_true",
                       help="print our dynamic-CP schedule (vs Megatron's and fixed CP) per global batch")
    group.add_argument("--dynamic-cp-mix", choices=["long-tail", "uniform"], default="long-tail")
    group.add_argument("--dynamic-cp-lengths", default=None, help="file of document lengths (overrides the mix)")
    group.add_argument("--dynamic-cp-batches", type=int, default=1, help="global batches to plan")
    group.add_argument("--ring-cp-scheduler", action="store_true",
                       help="with --hybrid-context-parallel: our scheduler (cost model) instead of Megatron's "
                            "BalancedCPScheduler in Megatron's hybrid-CP data path")
    group = parser.add_argument_group("documents (megatron_ring example)")
    group.add_argument("--documents", action="store_true",
                       help="samples are three documents each (cu_seqlens); attention and RoPE stay within documents "
                            "(implied by --hybrid-context-parallel; without it: the fixed-CP reference)")
    return parser


def _problem_and_machine(args):
    """The attention shape per TP rank and rough machine numbers (GPU-class, or this CPU's) for the cost model."""
    from megatron_ring import Machine, Problem

    heads = args.num_attention_heads // args.tensor_model_parallel_size
    groups = (args.num_query_groups or args.num_attention_heads) // args.tensor_model_parallel_size
    pb = Problem(batch=1, seq=0, heads=heads, kv_heads=max(1, groups), head_dim=args.kv_channels,
                 layout=args.cp_layout, elem_bytes=2 if (args.bf16 or args.fp16) else 4)
    m = Machine(flops=400e12, bw_intra=300e9, bw_inter=50e9, gpus_per_node=8, latency=20e-6, call_overhead=20e-6) \
        if torch.cuda.is_available() else Machine(flops=5e9, bw_intra=5e8, latency=1e-3, call_overhead=2e-4,
                                                  overlap=0.0)
    return pb, m


@contextlib.contextmanager
def ring_cp_scheduler():
    """With --ring-cp-scheduler: megatron.training builds its HybridCPDataLoaderWrapper as usual, and our
    RingCPScheduler (cost model, aligned power-of-two groups, one round) replaces its BalancedCPScheduler
    (the seam: ``use_ring_scheduler``; docs/dynamic_cp.md)."""
    import megatron.training.training as training

    base = getattr(training, "HybridCPDataLoaderWrapper", None)
    if base is None:  # this megatron.training has no hybrid-CP data path
        yield
        return

    def wrapper(data_iterator, config, *rest, **kwargs):
        made = base(data_iterator, config, *rest, **kwargs)
        args = get_args()
        if getattr(args, "ring_cp_scheduler", False):
            from megatron_ring.megatron.groups.dynamic_cp import use_ring_scheduler

            pb, m = _problem_and_machine(args)
            use_ring_scheduler(made, problem=pb, machine=m, seed=args.seed)
            if dist.get_rank() == 0:
                print("[ring-cp-scheduler] RingCPScheduler replaces BalancedCPScheduler in Megatron's hybrid-CP "
                      "data path", flush=True)
        return made

    training.HybridCPDataLoaderWrapper = wrapper
    try:
        yield
    finally:
        training.HybridCPDataLoaderWrapper = base


def plan_dynamic_cp(args) -> None:
    """Rank 0 prints the plan of each of the first --dynamic-cp-batches global batches: documents from
    the file (cut into global batches of --global-batch-size documents) or the seeded mix."""
    if not getattr(args, "dynamic_cp", False) or dist.get_rank() != 0:
        return
    from megatron_ring_lab import dynamic_plan as dp

    world = dist.get_world_size() // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    cap = getattr(args, "max_seqlen_per_dp_cp_rank", None) or args.seq_length
    pb, m = _problem_and_machine(args)
    n = args.global_batch_size
    every = dp.read_lengths(args.dynamic_cp_lengths) if args.dynamic_cp_lengths else None
    for b in range(args.dynamic_cp_batches):
        lens = every[b * n:(b + 1) * n] if every else dp.doc_lengths(args.dynamic_cp_mix, n, args.seed + b)
        if not lens:
            break
        print(f"[dynamic-cp] global batch {b}: {len(lens)} documents, {sum(lens)} tokens, DP x CP = {world}, "
              f"cap {cap} tokens/rank (predicted, one layer's attention):", flush=True)
        print(dp.format_table(dp.compare([min(x, cap * world) for x in lens], world, pb, m, cap), world), flush=True)


def main() -> None:
    cpu = contextlib.nullcontext() if torch.cuda.is_available() else megatron_training_cpu()
    with cpu, ring_cp_scheduler():
        compat.run_pretrain(pretrain, train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                            forward_step, extra_args_provider=add_args,
                            args_defaults={"tokenizer_type": "NullTokenizer"})
        _log_peak_memory()


if __name__ == "__main__":
    main()
