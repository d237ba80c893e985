"""Measuring helpers shared by the benchmark's parts: resident and peak memory, warm-up (timing: :mod:`megatron_ring.timing`)."""
from __future__ import annotations

import os
import resource

__all__ = ["rss_mib", "peak_mib", "warm_up", "rank_inputs", "DTYPES", "BENCH_ENV"]

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch dtype name

def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warm_up(attn, seq: int, dtype) -> None:
    """One tiny forward+backward, so one-off start-up memory is not counted as the run's peak.

    The backward takes an explicit gradient, as the measured calls do: the first such call costs
    ~40 MiB of one-off autograd state (a ``.sum().backward()`` warm-up does not take that path).
    """
    import torch

    q, k, v = (torch.randn(1, seq, 2, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    out = attn(q, k, v)
    out.backward(torch.randn_like(out))


def rank_inputs(cfg: dict, rank: int, world: int, dtype=None, g=None):
    """This rank's ``q, k, v, dout`` (``[batch, seq / world, heads, head_dim]``) in ``dtype`` (default:
    ``cfg["dtype"]``, a key of :data:`DTYPES`), q/k/v drawn from ``g`` (default: a generator seeded by the
    rank; pass one to draw more from it afterwards)."""
    import torch

    dtype = dtype or getattr(torch, DTYPES[cfg["dtype"]])
    s = cfg["seq"] // world
    g = g if g is not None else torch.Generator().manual_seed(rank)
    mk = lambda h: torch.randn(cfg["batch"], s, h, cfg["head_dim"], generator=g).to(dtype)  # noqa: E731
    q, k, v = mk(cfg["heads"]), mk(cfg["kv_heads"]), mk(cfg["kv_heads"])
    return q, k, v, torch.randn_like(q)


BENCH_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks via mmap: freed memory leaves RSS at once
