"""Train a small Megatron-Core GPT with ring-attention context parallelism on CPU/gloo.

    torchrun --nproc-per-node 4 examples/train_gpt.py --context-parallel-size 4
    torchrun --nproc-per-node 1 examples/train_gpt.py --context-parallel-size 1   # the CP = 1 baseline
    torchrun --nproc-per-node 4 examples/train_gpt.py --tensor-model-parallel-size 2 --context-parallel-size 2
    torchrun --nproc-per-node 4 examples/train_gpt.py --context-parallel-size 4 --pack-documents [--window-size 256]

Model: Megatron-Core ``GPTModel`` (RMSNorm, SwiGLU, RoPE, GQA), byte-level vocabulary (256). Corpus: the
Python standard library's own source files (always present, deterministic), or ``--corpus FILE``.
At CP = 1 the default ``--attention-impl auto`` uses Megatron's own local attention (the reference);
at CP > 1 it uses ``get_gpt_layer_ring_spec``. Every step prints loss, tokens/s and peak memory (max over
ranks of the process peak RSS). ``--log-json`` writes the per-step log for examples/cp_demo.py.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
try:  # run from a checkout without installing
    import megatron_ring  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_ring.megatron import (add_context_parallel_args, allreduce_gradients, config_from_args, get_batch_on_this_cp_rank, get_gpt_layer_ring_spec, initialize_context_parallel, reduce_loss_over_cp, use_layout_rope)  # noqa: E402
from megatron_ring_lab.cpu import megatron_cpu
from megatron_ring.megatron.data.documents import packed_batch  # noqa: E402

VOCAB = 256  # bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of every process group (collectives, and ring waits unless "
                        "--cp-timeout-seconds is set)")
    p.add_argument("--attention-impl", choices=["auto", "ring", "local"], default="auto",
                   help="auto: Megatron's local attention at CP=1, ring attention at CP>1")
    p.add_argument("--corpus", type=str, default=None, help="text file (default: Python stdlib sources)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--log-json", type=str, default=None, help="write the per-step log here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument("--pack-documents", action="store_true",
                   help="pack documents of random lengths (corpus slices ending in an EOD byte 0) into each "
                        "row; attention stays inside documents. Ring attention gets the micro-batch as one "
                        "packed THD stream with PackedSeqParams (global cu_seqlens; RoPE restarts per "
                        "document); Megatron's local attention (CP=1) gets the same documents as a "
                        "--reset-attention-mask style mask (position ids restart per document)")
    p.add_argument("--pack-as-mask", action="store_true",
                   help="with --pack-documents and ring attention: feed the mask instead of PackedSeqParams")
    p.add_argument("--mean-doc-length", type=int, default=128, help="mean document length for --pack-documents")
    p.add_argument("--window-size", type=int, default=None,
                   help="causal sliding window: each token sees itself and the previous N tokens "
                        "(TransformerConfig.window_size=(N, 0)); at CP=1 pass --attention-impl ring")
    add_context_parallel_args(p)
    return p.parse_args(argv)


def load_corpus(path: str | None, max_bytes: int = 4 << 20) -> torch.Tensor:
    """Byte tokens (uint8 ``[n]``) of ``path`` or of the stdlib's ``*.py`` files in sorted order."""
    if path:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    else:
        chunks, total = [], 0
        for fn in sorted(glob.glob(os.path.join(os.path.dirname(argparse.__file__), "*.py"))):
            with open(fn, "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(corpus: torch.Tensor, it: int, args: argparse.Namespace, dp_rank: int) -> dict[str, torch.Tensor]:
    """The full-sequence batch ``[b, s]`` of this DP replica for iteration ``it`` (same on TP/CP peers)."""
    b, s = args.micro_batch_size, args.seq_length
    g = torch.Generator().manual_seed(args.seed * 100_003 + it)
    starts = torch.randint(0, corpus.numel() - s - 1, (ps.get_data_parallel_world_size() * b,), generator=g)
    starts = starts[dp_rank * b:(dp_rank + 1) * b]
    rows = torch.stack([corpus[i:i + s + 1].long() for i in starts.tolist()])
    if args.pack_documents:
        return _pack(rows, args, g)
    return dict(tokens=rows[:, :-1].contiguous(), labels=rows[:, 1:].contiguous(),
                loss_mask=torch.ones(b, s), position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous())


EOD = 0  # byte 0 never occurs in the text corpus


def _pack(rows: torch.Tensor, args: argparse.Namespace, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Each row becomes documents of random lengths (exponential, mean --mean-doc-length, 1 and
    longer-than-a-shard included) separated by EOD; the document mask and restarting position ids are
    what Megatron's --reset-attention-mask --reset-position-ids build."""
    from megatron_ring.megatron.data.documents import document_mask

    rows = rows.clone()
    s = args.seq_length
    for r in range(rows.size(0)):
        pos = 0
        while True:
            pos += 1 + int(torch.empty(1).exponential_(1.0 / args.mean_doc_length, generator=g))
            if pos >= s:
                break
            rows[r, pos - 1] = EOD  # the last token of a document
    tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    mask, position_ids = document_mask(tokens, EOD)
    loss_mask = (tokens != EOD).float()  # do not predict across a document boundary
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                attention_mask=mask)


def build_model(args: argparse.Namespace, ring: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=4 * args.hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=args.attention_dropout, params_dtype=torch.float32,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        window_size=(args.window_size, 0) if args.window_size is not None else None)
    spec = (get_gpt_layer_ring_spec if ring else get_gpt_layer_local_spec)(normalization="RMSNorm")
    torch.manual_seed(args.seed)  # same full weights on every rank (CPU init splits them by TP)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=args.seq_length,
                     position_embedding_type="rope")
    if ring:
        use_layout_rope(model)
    return model


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        # torchrun provides RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    rank = dist.get_rank()
    ring_cfg = config_from_args(args)  # fails here, on every rank, naming the flag
    ring = args.attention_impl == "ring" or (args.attention_impl == "auto" and args.context_parallel_size > 1)
    corpus = load_corpus(args.corpus)
    with megatron_cpu():
        state = initialize_context_parallel(ring_cfg, tensor_model_parallel_size=args.tensor_model_parallel_size,
                                            seq_length=args.seq_length,
                                            distributed_timeout_minutes=max(1, round(args.distributed_timeout_minutes)))
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        model = build_model(args, ring)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n_params = sum(p.numel() for p in model.parameters())
        base_rss = peak_rss_mib()
        if rank == 0:
            print(f"[train_gpt] world={dist.get_world_size()} tp={args.tensor_model_parallel_size} "
                  f"cp={state.size} dp={dp} layout={state.layout} wire={ring_cfg.comm_dtype} "
                  f"attention={'ring' if ring else 'megatron-local'} seq={args.seq_length} "
                  f"params/rank={n_params / 1e6:.2f}M", flush=True)
        log = []
        for it in range(args.train_iters):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            batch, kw = get_batch(corpus, it, args, dp_rank), {}
            if args.pack_documents and ring and not args.pack_as_mask:  # Megatron's packed-sequence path
                batch = packed_batch(batch)
                kw["packed_seq_params"] = batch.pop("packed_seq_params")
            batch = get_batch_on_this_cp_rank(batch)
            per_token = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                              labels=batch["labels"], **kw)
            red = reduce_loss_over_cp(per_token, batch["loss_mask"])
            red.loss.backward()
            allreduce_gradients(model)
            opt.step()
            stats = torch.tensor([float(red.reported) / dp, peak_rss_mib()])
            dist.all_reduce(stats[:1], group=ps.get_data_parallel_group())
            mem = stats[1:].clone()
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            dt = time.perf_counter() - t0
            tok_s = dp * args.micro_batch_size * args.seq_length / dt
            row = dict(step=it + 1, loss=float(stats[0]), tokens_per_s=tok_s, step_s=dt, peak_rss_mib=float(mem))
            log.append(row)
            if rank == 0 and not args.quiet:
                print(f"step {it + 1:4d} | loss {row['loss']:.4f} | {tok_s:8.0f} tok/s | {dt:6.3f} s | "
                      f"peak RSS/rank {row['peak_rss_mib']:7.0f} MiB", flush=True)
        steady = log[1:] or log
        summary = dict(world=dist.get_world_size(), tp=args.tensor_model_parallel_size, cp=state.size, dp=dp,
                       layout=state.layout, seq_length=args.seq_length, attention="ring" if ring else "local",
                       tokens_per_s=sum(r["tokens_per_s"] for r in steady) / len(steady),
                       peak_rss_mib=max(r["peak_rss_mib"] for r in log), startup_rss_mib=base_rss, log=log)
        if rank == 0:
            print(f"[train_gpt] done: final loss {log[-1]['loss']:.4f}, {summary['tokens_per_s']:.0f} tok/s "
                  f"(mean after step 1), peak RSS/rank {summary['peak_rss_mib']:.0f} MiB", flush=True)
            if args.log_json:
                with open(args.log_json, "w") as f:
                    json.dump(summary, f, indent=1)
        ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
