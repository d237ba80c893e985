"""The main demo: Megatron-LM's own training loop (``megatron.training.pretrain``) at CP = 1 and CP = 4.

    python examples/pretrain_demo.py                       # 20 iterations, seq 512, CP=1 (1 process) vs CP=4 (4)
    python examples/pretrain_demo.py --iters 40 --seq-length 1024 --cp-layout striped

Both runs are ``torchrun examples/pretrain_ring_gpt.py`` on CPU/gloo with the same GPT, data and seed: CP = 1
uses Megatron's own local attention, CP = 4 megatron_ring's ring attention. Megatron's per-iteration log
lines are shown as it prints them; then both loss curves side by side (float64 loss sums over DP x CP, not
Megatron's 6-digit print), max |diff|, tokens/s (median over iterations after the first) and the peak
resident memory of every rank. Extra arguments after ``--`` go to both runs.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU_FLAGS = ("--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion "
             "--transformer-impl local --rerun-mode disabled --no-rope-fusion --no-bias-swiglu-fusion "
             "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm").split()


def model_flags(a: argparse.Namespace) -> list[str]:
    return (f"--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
            f"--seq-length {a.seq_length} --max-position-embeddings {a.seq_length} --micro-batch-size 2 "
            f"--global-batch-size 2 --train-iters {a.iters} --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
            "--lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --position-embedding-type rope "
            "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
            "--attention-dropout 0 --hidden-dropout 0 --vocab-size 256 --make-vocab-size-divisible-by 64 "
            "--tokenizer-type NullTokenizer --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 100000"
            ).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cp: int, a: argparse.Namespace, extra: list[str], workdir: str) -> dict:
    log = os.path.join(workdir, f"cp{cp}.loss")
    env = dict(os.environ, MEGATRON_RING_LOSS_LOG=log, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.join(HERE, "pretrain_ring_gpt.py"), *model_flags(a), *CPU_FLAGS,
           "--context-parallel-size", str(cp), "--cp-layout", a.cp_layout, *extra]
    tag = f"[CP={cp}{' ring' if cp > 1 else ' Megatron attention'}]"
    print(f"\n{tag} torchrun --nproc-per-node {cp} examples/pretrain_ring_gpt.py ...", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # Megatron's own progress lines, as it prints them
        tail = (tail + [line])[-60:]
        if " iteration " in line or "megatron_ring:" in line:
            print(f"{tag} {line.strip()}", flush=True)
    if proc.wait(timeout=a.timeout) != 0:
        sys.stderr.write("".join(tail))
        raise SystemExit(f"{tag} failed (exit {proc.returncode})")
    rows = [tuple(map(float, ln.split())) for ln in open(log)]
    losses = [r[0] / r[1] for r in rows]  # one micro-batch per iteration (global batch = micro batch, DP = 1)
    times = [r[2] for r in rows]
    steps = [t1 - t0 for t0, t1 in zip(times, times[1:])]
    mem = [int(open(f"{log}.mem{r}").read()) for r in range(cp)]
    tokens = 2 * a.seq_length  # global batch x sequence
    return {"losses": losses, "tok_s": tokens / statistics.median(steps) if steps else float("nan"), "mem": mem}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "striped", "contiguous"])
    p.add_argument("--timeout", type=float, default=900)
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    with tempfile.TemporaryDirectory() as d:
        base = run(1, a, extra, d)
        ring = run(a.cp, a, extra, d)
    diffs = [abs(x - y) for x, y in zip(base["losses"], ring["losses"])]
    print(f"\nMegatron's pretrain() loop, same GPT and data: CP=1 (Megatron's attention) vs CP={a.cp} "
          f"(ring, --cp-layout {a.cp_layout}), seq {a.seq_length}")
    print(f"{'iter':>5} {'loss CP=1':>14} {f'loss CP={a.cp}':>14} {'|diff|':>10}")
    for i, (x, y, dd) in enumerate(zip(base["losses"], ring["losses"], diffs), 1):
        print(f"{i:>5} {x:>14.8f} {y:>14.8f} {dd:>10.2e}")
    print(f"max |diff| = {max(diffs):.2e} over {len(diffs)} iterations")
    print(f"tokens/s (median iteration): CP=1 {base['tok_s']:.0f}, CP={a.cp} {ring['tok_s']:.0f} "
          f"(all {a.cp} processes share this machine's cores)")
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"peak RSS per rank (MiB): CP=1 [{', '.join(map(mib, base['mem']))}], "
          f"CP={a.cp} [{', '.join(map(mib, ring['mem']))}]")
    return 0 if max(diffs) <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
