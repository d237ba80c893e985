"""FSDP2 x context parallelism with the ring, PyTorch-native (no Megatron): a tiny causal transformer trained
with FSDP2 ``fully_shard`` over a ``dp x cp`` device mesh, its attention ``ring_attention(group=mesh["cp"]
.get_group())``, AdamW; each rank holds its data-parallel rows and its context-parallel part of the sequence.

    torchrun --standalone --nproc-per-node 4 examples/fsdp2_ring.py --dp 2 --cp 2 [--layout zigzag] [--steps 3]

How the pieces fit:

* ``init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))``; ``fully_shard(module, mesh=mesh)``
  on the 2-D mesh is HSDP: parameters sharded over ``cp``, replicated over ``dp``; gradients are
  reduce-scattered (mean) over ``cp`` and all-reduced (mean) over ``dp``. Every rank's loss is the mean over
  ITS tokens (the same count on every rank), so the mean over all ranks is the gradient of the global mean
  loss: the CP ranks of a data-parallel row must be averaged like data-parallel ranks, and HSDP over the
  whole ``dp x cp`` mesh does exactly that (a mesh over ``dp`` only would leave CP gradients unsummed).
* Input rows: ``x[dp_rank]``, then ``shard_sequence(x, 1, group=cp_group, layout=...)``; the position
  signal is added BEFORE sharding (the model sees global positions), and the targets are sharded the same way.

Exit: the script ends with :func:`shutdown` (see its doc and docs/fsdp2.md): on torch 2.13 CPU (Python 3.11)
a rank sometimes aborts at the interpreter's shutdown ("terminate called without an active exception",
about 1 run in 20, FSDP2 alone too); ending the process after a barrier without that shutdown avoids it.

``--out FILE`` (rank 0) writes the per-step losses and the step-1 gradients (full tensors) as a torch file;
``tests/test_fsdp2_ring.py`` compares them with one process in float64.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, HEADS, SEQ, BATCH_PER_DP, LAYERS, LR = 32, 4, 32, 2, 2, 1e-2


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP; ``attend(q, k, v)`` takes and returns ``[b, s, h, d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        x = x + self.proj(attend(q, k, v).reshape(b, s, HIDDEN))
        return x + self.mlp(self.norm2(x))


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x).squeeze(-1)


def make_model(dtype: torch.dtype = torch.float32) -> TinyModel:
    torch.manual_seed(0)  # the same initial weights on every rank and in the one-process reference
    return TinyModel().to(dtype)


def make_data(dp: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the GLOBAL batch ``(x [dp * BATCH_PER_DP, SEQ, HIDDEN], target [.., SEQ])``, positions added."""
    g = torch.Generator().manual_seed(1)
    pos = torch.sin(torch.arange(SEQ)[:, None] / (10.0 ** (torch.arange(HIDDEN) / HIDDEN)))
    return [(torch.randn(dp * BATCH_PER_DP, SEQ, HIDDEN, generator=g) + pos,
             torch.randn(dp * BATCH_PER_DP, SEQ, generator=g)) for _ in range(steps)]


def train(dp: int, cp: int, layout: str, steps: int) -> dict:
    """FSDP2 over a ``dp x cp`` mesh, ring attention over ``cp``; the default group must be up (``dp * cp``
    ranks). Returns (on every rank) the global losses per step and the step-1 gradients as full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megatron_ring import ring_attention, shard_sequence

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group, dp_rank = mesh["cp"].get_group(), mesh["dp"].get_local_rank()
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def attend(q, k, v):
        return ring_attention(q, k, v, causal=True, layout=layout, group=cp_group)

    losses, grads = [], {}
    rows = slice(dp_rank * BATCH_PER_DP, (dp_rank + 1) * BATCH_PER_DP)
    for step, (x, target) in enumerate(make_data(dp, steps)):
        x, target = (shard_sequence(t[rows], 1, group=cp_group, layout=layout) for t in (x, target))
        loss = F.mse_loss(model(x, attend), target)  # mean over this rank's tokens
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / (dp * cp))
        if step == 0:
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def shutdown() -> NoReturn:
    """End the process without the interpreter's shutdown (torch 2.13 CPU work-around; docs/fsdp2.md).

    A barrier (every rank is done with every collective), ``destroy_process_group()``, then ``os._exit(0)``
    after flushing stdout/stderr. Why: a gloo worker thread (``pt_gloo_runloop``) that destroys a finished
    collective's work drops a Python object it captured, which takes the GIL; if the interpreter is already
    finalizing, Python 3.11 ends that thread with ``pthread_exit``, whose forced unwinding through a
    ``noexcept`` C++ destructor calls ``std::terminate`` ("terminate called without an active exception",
    SIGABRT). ``destroy_process_group()`` alone does not avoid it: the device mesh's groups and their
    worker threads outlive it. Without finalization no thread can meet a finalizing interpreter."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    ap.add_argument("--layout", default="zigzag", help='"zigzag", "striped", "contiguous", or "all"')
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="rank 0 saves {layout: {losses, grads}} here (torch.save)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != args.dp * args.cp:
        raise SystemExit(f"world size {dist.get_world_size()} != dp * cp = {args.dp * args.cp}")
    layouts = ["zigzag", "striped", "contiguous"] if args.layout == "all" else [args.layout]
    results = {}
    for layout in layouts:
        results[layout] = train(args.dp, args.cp, layout, args.steps)
        if dist.get_rank() == 0:
            print(f"dp={args.dp} cp={args.cp} {layout}: losses "
                  + " ".join(f"{x:.6f}" for x in results[layout]["losses"]), flush=True)
    if args.out and dist.get_rank() == 0:
        torch.save(results, args.out)
    shutdown()  # on success only: an error is raised as usual (and its rank exits non-zero)


if __name__ == "__main__":
    main()
