"""The largest attention logit per query row: an extra pass over the blocks a ring step computes.

QK-clip (``ring_attention(..., return_max_logit=True)``) needs, per query head, the max of the scaled
logits ``scale * q . k`` over the pairs the queries can see. The block kernels return ``(out, lse)`` only
(torch's CPU flash op, SDPA, the math kernel), and lse cannot give the max back, so the engine runs this
pass on each task it computes, on the same (decoded) K block and under the same mask the kernel is given.

:func:`fold_task_max` folds one task into a running ``[h, s]`` fp32 tensor of per-row maxima (max over
the batch and the visible keys; ``-inf`` where a row has seen nothing). Rows are kept apart, not reduced to
``[h]`` at once, so a strategy that computes several ranks' queries in one tensor (Ulysses) can hand each
rank the rows it owns. Scores are computed by one matmul per chunk of query rows (fp32 accumulation; in bf16
for bf16 inputs, else fp32: :func:`score_dtype`), the scale applied to the row maxima; at most :data:`BUDGET`
score elements are in memory at once (never a whole block's score matrix for large blocks); nothing is read
on the host.
"""
from __future__ import annotations

import torch

from megatron_ring.schedules.layouts import TaskKind

__all__ = ["fold_task_max", "new_row_max", "score_dtype", "BUDGET"]

#: score elements (fp32) materialised at once per call of the pass: 2^22 (16 MiB)
BUDGET = 1 << 22


def new_row_max(h: int, s: int, device: torch.device) -> torch.Tensor:
    """A fresh ``[h, s]`` fp32 accumulator: ``-inf`` (no visible pair yet)."""
    return torch.full((h, s), float("-inf"), dtype=torch.float32, device=device)


def fold_task_max(acc: torch.Tensor, task, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
    """Fold the scores of ``task`` into ``acc`` (in place, no gradient).

    ``acc``: ``[h, s]`` fp32 per-row maxima of the query heads of ``q``; ``q [b, h, s, d]`` (all local rows;
    the task's rows ``task.q`` are read), ``k [b, h_kv, sk, d]`` the visiting keys (the task's ``task.kv``).
    The task's visibility is its kind's: every pair (full), ``j <= i`` (top-left causal), ``j >= i + sk - sq``
    (reversed: causal on reversed rows), or its explicit mask. A chunk of query rows reads only the keys it may
    see, and only the keys some of its rows do not see (a triangle's diagonal band, a masked task) are masked."""
    rows, cols = task.q, task.kv
    qt, kt = q[:, :, rows], k[:, :, cols]
    b, h, sq, d = qt.shape
    h_kv, sk = kt.shape[1], kt.shape[2]
    if sq == 0 or sk == 0:
        return
    g, kind = h // h_kv, task.kind
    dtype = score_dtype(q.dtype)
    allowed = task.explicit_mask().allowed(q.device) if kind is TaskKind.MASKED else None
    with torch.no_grad():
        kc = kt.to(dtype).contiguous()  # [b, h_kv, sk, d], once per task (its transpose is a BLAS operand)
        step = max(1, BUDGET // max(1, b * h * sk))
        for a in range(0, sq, step):
            e = min(sq, a + step)
            lo, hi, t0, t1 = _key_span(kind, a, e, sq, sk)
            qg = qt[:, :, a:e].to(dtype).reshape(b, h_kv, g * (e - a), d)  # query heads of a K/V head as rows
            s = torch.matmul(qg, kc[:, :, lo:hi].transpose(-1, -2)).view(b, h_kv, g, e - a, hi - lo)
            row_max = None
            for x0, x1 in ((lo, t0), (t1, hi)):  # keys every row of the chunk sees
                if x1 > x0:
                    row_max = _max_in(row_max, s[..., x0 - lo:x1 - lo])
            if t1 > t0:  # the keys the mask decides
                band = s[..., t0 - lo:t1 - lo].masked_fill(_hidden(kind, allowed, a, e, t0, t1, sq, sk, q.device),
                                                           float("-inf"))
                row_max = _max_in(row_max, band)
            dst = acc[:, rows.start + a:rows.start + e]
            torch.maximum(dst, row_max.reshape(h, e - a).float().mul_(scale), out=dst)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the pass computes ``q . k`` in: bf16 for bf16 inputs (the matmul accumulates in fp32 and rounds
    the score once; rounding is monotone, so the max is the bf16 rounding of the max: relative error
    ``2^-9``), else fp32 (fp16 scores can overflow; fp32 and wider inputs are cast to fp32)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _max_in(running: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    """The max over the batch (dim 0) and the keys (last dim) of ``s``, folded into ``running``."""
    m = s.amax(dim=(0, -1))
    return m if running is None else torch.maximum(running, m)


def _key_span(kind: TaskKind, a: int, e: int, sq: int, sk: int) -> tuple[int, int, int, int]:
    """For the query rows ``a:e`` of a task of this kind: ``lo, hi``, the keys some row may see, and ``t0, t1``,
    the keys within them that not every row sees (the mask decides those; the others are visible to all)."""
    if kind is TaskKind.FULL:
        return 0, sk, 0, 0
    if kind is TaskKind.MASKED:
        return 0, sk, 0, sk
    if kind is TaskKind.CAUSAL:  # j <= i: keys < a are seen by every row, keys a..e-1 by some
        hi = min(sk, e)
        return 0, hi, min(a, hi), hi
    off = sk - sq  # REVERSED: j >= i + off: keys >= e - 1 + off are seen by every row
    lo = max(0, a + off)
    return lo, sk, lo, min(sk, max(lo, e - 1 + off))


def _hidden(kind: TaskKind, allowed, a: int, e: int, t0: int, t1: int, sq: int, sk: int, device) -> torch.Tensor:
    """Bool ``[e - a, t1 - t0]``: the hidden pairs of the query rows ``a:e`` and key rows ``t0:t1``."""
    if kind is TaskKind.MASKED:
        return ~allowed[a:e, t0:t1]
    i = torch.arange(a, e, device=device)[:, None]
    j = torch.arange(t0, t1, device=device)[None, :]
    if kind is TaskKind.CAUSAL:
        return j > i
    return j < i + (sk - sq)  # REVERSED: top-left causal once query and key rows are both reversed
