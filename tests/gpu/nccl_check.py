"""Ring attention over NCCL on this machine's GPUs vs one-GPU float64 math (run by scripts/gpu_check.sh).

    torchrun --nproc-per-node N tests/gpu/nccl_check.py [--seq 8192]

Each rank holds its zigzag share; for comm types p2p / all_gather / a2a, causal, GQA, bf16 and fp32, the
outputs and input gradients are gathered and compared with float64 attention of the whole sequence on
rank 0, and the forward+backward time (median of 5, slowest rank) is taken. Rank 0 prints one JSON line
per case (``{"case": ..., "max_err": ..., "ms": ...}``). Bounds: fp32 2e-4, bf16 3e-2 (absolute).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from tests.helpers.reference import attention_reference  # noqa: E402

from megatron_ring import gather_sequence, ring_attention, shard_sequence  # noqa: E402

BOUNDS = {"float32": 2e-4, "bfloat16": 3e-2}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(1)
        q, dout = (torch.randn(1, a.seq, 8, 64, generator=g) for _ in range(2))
        k, v = (torch.randn(1, a.seq, 2, 64, generator=g) for _ in range(2))
        ref = None
        if rank == 0:
            leaves = [t.to(dev, torch.float64).requires_grad_() for t in (q, k, v)]
            out = attention_reference(*leaves, causal=True)
            out.backward(dout.to(dev, torch.float64))
            ref = [out.detach()] + [t.grad for t in leaves]
        for ct in ("p2p", "all_gather", "a2a"):
            local = [shard_sequence(t.to(dev, dtype), 1).detach().requires_grad_() for t in (q, k, v)]
            d_local = shard_sequence(dout.to(dev, dtype), 1)

            def step():
                for t in local:
                    t.grad = None
                o = ring_attention(*local, causal=True, comm_type=ct)
                o.backward(d_local)
                return o

            times = []
            for _ in range(6):
                torch.cuda.synchronize()
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                o = step()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            t = torch.tensor([statistics.median(times[1:])], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            got = [gather_sequence(x.detach(), 1) for x in (o, *[t_.grad for t_ in local])]
            if rank == 0:
                err = max((x.double() - r).abs().max().item() for x, r in zip(got, ref))
                name = str(dtype).split(".")[-1]
                good = err <= BOUNDS[name]
                ok &= good
                print(json.dumps({"case": f"nccl P={world} {ct} {name} S={a.seq}", "max_err": err,
                                  "ms": round(t.item(), 2), "ok": good}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
