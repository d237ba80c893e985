"""Host time of one Megatron core-attention layer call, glue and engine (``python -m megatron_ring_lab.benchmark
--layer-host-time``).

What a GPU pays per layer call before any kernel runs when the host cannot run ahead of the device: the
Megatron glue (``RingDotProductAttention.forward``: group lookup, settings, argument plumbing) on top of
``ring_attention``'s own host work. One process, one thread, CP = 1 (no process group: the one-rank loopback
ring), causal, a tiny ``sbhd`` shape so that the kernels' own work is small next to the host's. Timed, taking
turns every :data:`BURST` calls: the layer's forward+backward (``layer``) and the same ``ring_attention`` call
made directly (``ring``); ``glue`` = layer - ring. Medians of the calling thread's CPU time (the machine's other
load does not count). ``device="cuda"`` (``--device cuda``): the same calls on the GPU, bf16, timed by the wall
clock from launch to return with the device idle before each call (autograd runs a CUDA backward on its own
thread, whose CPU time the calling thread's clock would miss); what the host spends per layer call, the
kernels' time excluded. ``packed=True`` (``--packed``): a packed THD batch of three documents, as Megatron passes it
(``[t, 1, h, d]`` and ``PackedSeqParams`` with its ``cu_seqlens`` on the device); ``layer`` then calls the layer with
the same params every time (a micro-batch's later layers), ``first_layer`` with new params each call (the first
layer of each micro-batch: it reads them on the host), and ``ring`` passes ``ring_attention`` the boundaries as a
host tensor, kept. Also printed: a hash of the layer's output and input gradients (the same bytes before and
after a change: ``scripts/bench_revisions.py --layer-host-time`` compares them).

This file imports only public pieces of the library (``ring_attention``, ``RingDotProductAttention``) and
megatron-core, nothing of ``megatron_ring_lab``, so ``scripts/bench_revisions.py`` runs it against an older
revision side by side.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["layer_host_times", "format_layer_host_time"]

#: calls in a row per mode before the other takes its turn
BURST = 10


def _layer(heads: int, kv_heads: int, head_dim: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ring.megatron import RingDotProductAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=kv_heads, use_cpu_initialization=True, context_parallel_size=1,
                            transformer_impl="local", attention_dropout=0.0)
    return RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                   pg_collection=SimpleNamespace(cp=None, tp=SimpleNamespace(size=lambda: 1)))


def _packed_params(seq: int, dev: torch.device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, seq // 3, seq - seq // 4, seq], dtype=torch.int32, device=dev)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=seq // 2,
                           max_seqlen_kv=seq // 2)


def layer_host_times(seq: int | None = None, batch: int = 1, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                     iters: int = 400, warmup: int = 20, device: str = "cpu", packed: bool = False) -> dict[str, Any]:
    """Median seconds of host time of one forward+backward, through the layer and directly (see the module doc:
    this thread's CPU time on CPU, launch to return on CUDA). ``seq``: tokens (default 16, packed 64)."""
    from megatron_ring import ring_attention

    seq = seq or (64 if packed else 16)
    torch.set_num_threads(1)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layer = _layer(heads, kv_heads, head_dim).to(dev)
    g = torch.Generator().manual_seed(0)
    made = lambda *shape: torch.randn(*shape, generator=g).to(dev, dtype)  # noqa: E731
    q = made(seq, batch, heads, head_dim).requires_grad_()
    k, v = (made(seq, batch, kv_heads, head_dim).requires_grad_() for _ in range(2))
    dout = made(seq, batch, heads * head_dim)

    params = _packed_params(seq, dev) if packed else None
    host_cu = params.cu_seqlens_q.cpu().long() if packed else None
    if packed and batch != 1:
        raise ValueError("packed: one stream (batch 1)")

    def through_layer():
        layer(q, k, v, None, packed_seq_params=params).backward(dout.view(seq, -1) if packed else dout)

    def first_layer():  # new params, as the first layer of each micro-batch gets them
        layer(q, k, v, None, packed_seq_params=_packed_params(seq, dev)).backward(dout.view(seq, -1))

    def direct():
        if packed:
            ring_attention(q[:, 0], k[:, 0], v[:, 0], causal=True, layout="zigzag", qkv_format="thd", cu_seqlens=host_cu,
                           softmax_scale=layer.softmax_scale).backward(dout.view(seq, heads, head_dim))
            return
        ring_attention(q, k, v, causal=True, layout="zigzag", qkv_format="sbhd",
                       softmax_scale=layer.softmax_scale).backward(dout.view(seq, batch, heads, head_dim))

    through_layer()
    digest = hashlib.sha256()
    for t in (layer(q, k, v, None, packed_seq_params=params).detach(), q.grad, k.grad, v.grad):
        digest.update(t.float().cpu().contiguous().numpy().tobytes())
    modes = {"layer": through_layer, "ring": direct}
    if packed:
        modes["first_layer"] = first_layer
    for _ in range(warmup):
        for call in modes.values():
            call()
    times: dict[str, list[float]] = {m: [] for m in modes}
    clock = time.perf_counter_ns if dev.type == "cuda" else time.thread_time_ns
    for _ in range(max(1, iters // BURST)):
        for mode, call in modes.items():
            for _ in range(BURST):
                q.grad = k.grad = v.grad = None
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # an idle device: the host never waits for a full queue
                t0 = clock()
                call()
                times[mode].append((clock() - t0) * 1e-9)
    layer_s, ring_s = statistics.median(times["layer"]), statistics.median(times["ring"])
    row = dict(seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, iters=iters,
               device=dev.type, dtype=str(dtype).removeprefix("torch."), packed=packed, layer_s=layer_s, ring_s=ring_s,
               glue_s=layer_s - ring_s, outputs_sha256=digest.hexdigest())
    if packed:
        row["first_layer_s"] = statistics.median(times["first_layer"])
        row["first_glue_s"] = row["first_layer_s"] - ring_s
    return row


def format_layer_host_time(row: dict[str, Any]) -> str:
    first = (f"first layer of a micro-batch {row['first_layer_s'] * 1e3:.3f} ms (glue {row['first_glue_s'] * 1e3:.3f} "
             "ms) | " if row.get("packed") else "")
    return (f"{'packed THD, ' if row.get('packed') else ''}layer fwd+bwd {row['layer_s'] * 1e3:.3f} ms | "
            f"ring_attention alone {row['ring_s'] * 1e3:.3f} ms | glue {row['glue_s'] * 1e3:.3f} ms | {first}"
            f"outputs sha256 {row['outputs_sha256'][:16]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 16; --packed: 64)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 on the GPU, wall clock")
    ap.add_argument("--packed", action="store_true", help="a packed THD batch of three documents (see the module doc)")
    ap.add_argument("--json", action="store_true", help="print the row as one JSON line (RESULT ...)")
    a = ap.parse_args(argv)
    row = layer_host_times(a.seq, 1, a.heads, a.kv_heads, a.head_dim, a.iters, device=a.device, packed=a.packed)
    print("RESULT " + json.dumps(row) if a.json else format_layer_host_time(row), flush=True)
    return row


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
