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
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from tests.gpu.timing import timed_ms  # noqa: E402
from tests.helpers.numerics import grad_terms, rel_tol, score_bound  # noqa: E402
from tests.helpers.reference import attention_reference  # noqa: E402

from megatron_ring import gather_sequence, ring_attention, shard_sequence  # noqa: E402


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

            ms, o = timed_ms(step, dev)
            got = [gather_sequence(x.detach(), 1) for x in (o, *[t_.grad for t_ in local])]
            if rank == 0:
                # derived bound per tensor (tests/helpers/numerics.py): the dtype's rounding, the stream
                # length, the score bound and the 2P blocks of the ring; dq/dk against their summands
                rel = rel_tol(dtype=dtype, n=a.seq, sigma=score_bound(q, k), blocks=2 * world)
                floor = grad_terms(q, k, v, dout, n=a.seq)
                ratio = max((x.double() - r).abs().max().item()
                            / (rel * max(r.abs().max().item(), floor if i in (1, 2) else 0.0))
                            for i, (x, r) in enumerate(zip(got, ref)))
                name = str(dtype).split(".")[-1]
                good = ratio <= 1.0
                ok &= good
                print(json.dumps({"case": f"nccl P={world} {ct} {name} S={a.seq}", "err_over_bound": ratio,
                                  "ms": ms, "ok": good}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
