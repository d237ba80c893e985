"""Ours vs TransformerEngine's context parallelism on this machine's GPUs, side by side (run by
scripts/gpu_check.sh where TransformerEngine is installed and there are 2 or more GPUs).

    torchrun --nproc-per-node N tests/gpu/te_cp_check.py [--seq 8192]

Each rank holds its zigzag share (TransformerEngine's causal CP layout is the same: chunks r and 2P-1-r);
for causal GQA bf16 with TransformerEngine's ``cp_comm_type`` "p2p" and "a2a" and ours with the same comm
type, the outputs and input gradients are gathered and compared with float64 attention of the whole
sequence on rank 0, and the forward+backward time (median of 5 after one warm-up, slowest rank) is taken.
Rank 0 prints one JSON line per case: ``{"case", "ours_err", "te_err", "ours_ms", "te_ms", "ok"}``; ``ok``
when our error is within twice TransformerEngine's plus one bf16 rounding (2^-8) of the largest reference
value. TransformerEngine's API (``DotProductAttention(..., cp_group, cp_global_ranks, cp_stream,
cp_comm_type)``, output ``[b, s, h * d]`` for ``bshd``) as of v2.9. Written without a GPU: never run yet.
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
from tests.helpers.reference import attention_reference  # noqa: E402

from megatron_ring import gather_sequence, ring_attention, shard_sequence  # noqa: E402


def main() -> int:
    import transformer_engine.pytorch as te

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, hk, d = 16, 4, 128
    g = torch.Generator(device="cpu").manual_seed(1)
    q, dout = (torch.randn(1, a.seq, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(1, a.seq, hk, d, generator=g) for _ in range(2))
    ref = None
    if rank == 0:
        leaves = [t.to(dev, torch.float64).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*leaves, causal=True)
        out.backward(dout.to(dev, torch.float64))
        ref = [out.detach()] + [t.grad for t in leaves]
    ok = True
    for ct in ("p2p", "a2a"):
        row = {"case": f"ours vs TE P={world} {ct} causal bf16 S={a.seq} h={h}/{hk} d={d}"}
        te_attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type="causal",
                                         cp_group=dist.group.WORLD, cp_global_ranks=list(range(world)),
                                         cp_stream=torch.cuda.Stream(), cp_comm_type=ct)
        for who, run in (("ours", lambda *x: ring_attention(*x, causal=True, comm_type=ct)),
                         ("te", lambda *x: te_attn(*x).view(*x[0].shape))):
            local = [shard_sequence(t.to(dev, dtype), 1).detach().requires_grad_() for t in (q, k, v)]
            d_local = shard_sequence(dout.to(dev, dtype), 1)
            box = []

            def step():
                for t in local:
                    t.grad = None
                o = run(*local)
                o.backward(d_local)
                box[:] = [o]

            row[f"{who}_ms"], _ = timed_ms(step, dev)
            got = [gather_sequence(x.detach(), 1) for x in (box[0], *[t.grad for t in local])]
            if rank == 0:
                row[f"{who}_err"] = max((x.double() - r).abs().max().item() for x, r in zip(got, ref))
        if rank == 0:
            bound = 2 * row["te_err"] + 2.0 ** -8 * max(r.abs().max().item() for r in ref)
            row["ok"] = row["ours_err"] <= bound
            ok &= row["ok"]
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
