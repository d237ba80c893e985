"""The README demo: train the same GPT at CP = 1 and CP = 4 and print both loss curves side by side.

    python examples/cp_demo.py                      # 30 steps, seq 1024, CP=1 (1 process) vs CP=4 (4 processes)
    python examples/cp_demo.py --steps 40 --seq-length 2048 --cp-layout striped

Each run is ``torchrun ... examples/train_gpt.py`` on CPU/gloo; CP = 1 uses Megatron-Core's own attention,
CP = 4 ring attention. Extra arguments after ``--`` go to both runs.
"""
from __future__ import annotations

import argparse
import sys

from train_gpt_job import run_train_gpt


def run(cp: int, args: argparse.Namespace, extra: list[str]) -> dict:
    return run_train_gpt(cp, ["--context-parallel-size", str(cp), "--train-iters", str(args.steps),
                              "--seq-length", str(args.seq_length), "--cp-layout", args.cp_layout, "--quiet",
                              *extra],
                         timeout=args.timeout, master_port=args.master_port and args.master_port + cp)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--cp", type=int, default=4, help="context-parallel size of the second run")
    p.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "striped", "contiguous"])
    p.add_argument("--master-port", type=int, default=0, help="0: torchrun --standalone picks a free port")
    p.add_argument("--timeout", type=float, default=1800)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    a = run(1, args, extra)
    b = run(args.cp, args, extra)
    print(f"\nseq {args.seq_length}, layout {args.cp_layout}: CP=1 ({a['attention']} attention) vs "
          f"CP={args.cp} ({b['attention']} attention)")
    print(f"{'step':>5} | {'loss CP=1':>10} | {f'loss CP={args.cp}':>10} | {'|diff|':>9}")
    worst = 0.0
    for ra, rb in zip(a["log"], b["log"]):
        d = abs(ra["loss"] - rb["loss"])
        worst = max(worst, d)
        print(f"{ra['step']:>5} | {ra['loss']:10.5f} | {rb['loss']:10.5f} | {d:9.2e}")
    print(f"max |diff| {worst:.2e}")
    for name, r in (("CP=1", a), (f"CP={args.cp}", b)):
        print(f"{name:>6}: {r['tokens_per_s']:8.0f} tokens/s (whole job), peak RSS per rank {r['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
