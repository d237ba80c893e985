"""Peak memory per rank vs sequence length, CP = 1 against CP = 4 (ring attention in both).

    python examples/memory_sweep.py --seq-lengths 4096 8192 16384 --cp 4

For each CP size and each length, runs 2 training steps of examples/train_gpt.py (``--attention-impl
ring``, so CP = 1 also uses the memory-lean flash-style kernel rather than Megatron's s x s scores) and
prints the peak RSS per rank (max over ranks) and the part above the after-model-build baseline.
CP = 4 runs ``--cp-seq-factor`` (default 4) times the length.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def one(cp: int, seq: int, args: argparse.Namespace, tmp: str) -> dict | None:
    out = os.path.join(tmp, f"cp{cp}_{seq}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-port",
           str(args.master_port), os.path.join(HERE, "train_gpt.py"), "--context-parallel-size", str(cp),
           "--seq-length", str(seq), "--train-iters", "2", "--attention-impl", "ring", "--quiet",
           "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers), "--log-json", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  cp={cp} seq={seq} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        return None
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--cp-seq-factor", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--master-port", type=int, default=29680)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    print(f"{'CP':>3} | {'seq':>7} | {'seq/rank':>8} | {'peak RSS/rank MiB':>17} | {'above baseline MiB':>18} | {'tok/s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq_lengths:
            for cp, s in ((1, seq), (args.cp, seq * args.cp_seq_factor)):
                r = one(cp, s, args, tmp)
                if r:
                    print(f"{cp:>3} | {s:>7} | {s // cp:>8} | {r['peak_rss_mib']:>17.0f} | "
                          f"{r['peak_rss_mib'] - r['startup_rss_mib']:>18.0f} | {r['tokens_per_s']:>7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
