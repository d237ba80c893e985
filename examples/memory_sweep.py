"""Peak memory per rank vs sequence length, CP = 1 against CP = 4 (ring attention in both).

    python examples/memory_sweep.py --seq-lengths 4096 8192 16384 --cp 4

For each CP size and each length, runs 2 training steps of examples/train_gpt.py (``--attention-impl
ring``, so CP = 1 also uses the memory-lean flash-style kernel rather than Megatron's s x s scores) and
prints the peak RSS per rank (max over ranks) and the part above the after-model-build baseline.
CP = 4 runs ``--cp-seq-factor`` (default 4) times the length.
"""
from __future__ import annotations

import argparse
import sys

from train_gpt_job import run_train_gpt


def one(cp: int, seq: int, args: argparse.Namespace) -> dict | None:
    return run_train_gpt(cp, ["--context-parallel-size", str(cp), "--seq-length", str(seq), "--train-iters", "2",
                              "--attention-impl", "ring", "--quiet", "--hidden-size", str(args.hidden_size),
                              "--num-layers", str(args.num_layers)],
                         timeout=args.timeout, master_port=args.master_port, quiet=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--cp-seq-factor", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--master-port", type=int, default=0, help="0: torchrun --standalone picks a free port")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    print(f"{'CP':>3} | {'seq':>7} | {'seq/rank':>8} | {'peak RSS/rank MiB':>17} | {'above baseline MiB':>18} | {'tok/s':>7}")
    for seq in args.seq_lengths:
        for cp, s in ((1, seq), (args.cp, seq * args.cp_seq_factor)):
            r = one(cp, s, args)
            if r:
                print(f"{cp:>3} | {s:>7} | {s // cp:>8} | {r['peak_rss_mib']:>17.0f} | "
                      f"{r['peak_rss_mib'] - r['startup_rss_mib']:>18.0f} | {r['tokens_per_s']:>7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
