"""``benchmark --features``: what MLA head dims, sinks and dropout cost per block (one process, 1 thread).

Rows (fwd+bwd of ring_attention at P=1, i.e. the block kernel plus the engine around it, medians):

* ``mla pad`` — d_qk != d_v through torch's CPU flash kernel with V zero-padded to d_qk (the default),
  vs ``mla math`` (the fp32 matmul kernel, which takes unequal dims natively) and ``equal dims`` (flash
  with d_v = d_qk: the padding's lower bound);
* ``sink`` — a learnable per-head softmax offset vs none;
* ``dropout`` — the positional-dropout kernel vs flash without dropout (same shapes).
"""
from __future__ import annotations

from typing import Any

from megatron_ring.timing import median_seconds

__all__ = ["run_features", "format_features"]


def run_features(seq: int, heads: int, iters: int, causal: bool = True) -> list[dict[str, Any]]:
    import torch

    from megatron_ring import ring_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    def case(dqk, dv, **kw):
        q = torch.randn(1, seq, heads, dqk, generator=g, requires_grad=True)
        k = torch.randn(1, seq, heads, dqk, generator=g, requires_grad=True)
        v = torch.randn(1, seq, heads, dv, generator=g, requires_grad=True)
        dout = torch.randn(1, seq, heads, dv, generator=g)
        sink = kw.pop("sink", None)
        if sink is not None:
            kw["softmax_offset"] = torch.zeros(heads, requires_grad=True)
        return lambda: ring_attention(q, k, v, causal=causal, **kw).backward(dout)

    rows = []
    pairs = [
        ("mla pad 192/128 (flash)", case(192, 128), "equal dims 192/192 (flash)", case(192, 192)),
        ("mla math 192/128", case(192, 128, kernel="math"), "mla pad 192/128 (flash)", case(192, 128)),
        ("sink learnable (flash, d=64)", case(64, 64, sink=True), "no sink (flash, d=64)", case(64, 64)),
        ("dropout p=0.1 (d=64)", case(64, 64, dropout_p=0.1, dropout_seed=1), "no dropout (flash, d=64)",
         case(64, 64)),
        ("dropout p=0.1 (d=64)", case(64, 64, dropout_p=0.1, dropout_seed=1), "no dropout (math, d=64)",
         case(64, 64, kernel="math")),
    ]
    for name, fn, base_name, base in pairs:
        t, tb = median_seconds(fn, iters), median_seconds(base, iters)
        rows.append({"case": name, "s": t, "vs": base_name, "vs_s": tb, "ratio": t / tb})
    return rows


def format_features(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':>30} | {'f+b s':>7} | {'vs':>30} | {'f+b s':>7} | ratio"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:>30} | {r['s']:7.3f} | {r['vs']:>30} | {r['vs_s']:7.3f} | {r['ratio']:.2f}")
    return "\n".join(lines)
