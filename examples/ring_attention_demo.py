"""Ring attention on 4 CPU processes: exactness against full attention, then a timing table.

    python examples/ring_attention_demo.py [--world-size 4] [--seq 2048] [--bench-seq 4096]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from megatron_ring import gather_sequence, ring_attention, shard_sequence
from megatron_ring_lab.launch import run_on_ranks


def full_attention_fp64(q, k, v, causal):
    """Full-sequence attention on one process: torch's SDPA in float64 (``[b, S, h, d]``)."""
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def check_worker(rank, world, seq):
    torch.manual_seed(0)  # same full tensors on every rank; each keeps only its shard
    q = torch.randn(1, seq, 8, 64)
    k, v = torch.randn(1, seq, 2, 64), torch.randn(1, seq, 2, 64)  # GQA: 8 query heads, 2 K/V heads
    rows = []
    for layout in ("zigzag", "striped", "contiguous"):
        for causal in (True, False):
            out = ring_attention(*(shard_sequence(t, 1, layout=layout) for t in (q, k, v)),
                                 causal=causal, layout=layout)
            full = gather_sequence(out, 1, layout=layout)
            if rank == 0:
                err = (full.double() - full_attention_fp64(q, k, v, causal)).abs().max().item()
                rows.append((layout, causal, err))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bench-seq", type=int, default=4096)
    a = ap.parse_args()
    print(f"ring attention on {a.world_size} CPU processes (gloo), S={a.seq}, 8 heads (2 K/V heads), d=64, fp32")
    rows = run_on_ranks(check_worker, a.world_size, a.seq, timeout=600)[0]
    print(f"{'layout':>10} | {'causal':>6} | max |ring - full attention (fp64)|")
    for layout, causal, err in rows:
        print(f"{layout:>10} | {str(causal):>6} | {err:.2e}")
    assert max(e for *_, e in rows) < 1e-4, "ring attention disagrees with full attention"
    print("\ntiming (python -m megatron_ring_lab.benchmark):")
    from megatron_ring_lab.bench.main import main as bench

    bench(["--world-sizes", "1", "2", str(a.world_size), "--seq", str(a.bench_seq), "--iters", "3"])


if __name__ == "__main__":
    main()
