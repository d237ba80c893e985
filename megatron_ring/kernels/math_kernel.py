"""The math kernels: fp32 scores materialised, in tiles of query rows (:class:`RowTiled`, :func:`row_tiles`) so that a
block's memory is bounded whatever its size; :class:`MathKernel` (every device and dtype, masks; the fallback of
the fused kernels) and, in kernels/dropout.py, the torch dropout kernel."""
from __future__ import annotations

import abc

import torch

from megatron_ring.kernels.base import BlockKernel, _finite_lse

__all__ = ["SCORE_BUDGET", "row_tiles", "hidden_pairs", "RowTiled", "MathKernel"]

#: the most elements one fp32 score tensor ``[b, h, rows, keys]`` of the math kernels holds (2^26: 256 MiB); a
#: larger block runs in tiles of query rows (:func:`row_tiles`), so the fallback's memory is bounded whatever the
#: block (fp32 on CUDA, GPUs before sm80, head dims over 256 run on it)
SCORE_BUDGET = 1 << 26


def row_tiles(b: int, h: int, sq: int, sk: int, causal: bool, budget: int = SCORE_BUDGET) -> list[tuple[slice, slice]]:
    """``(query rows, key rows)`` of each tile of a ``[b, h, sq, sk]`` block whose scores would exceed ``budget``
    elements: tiles of ``budget // (b h sk)`` rows (at least one); a top-left causal tile reads only the keys
    its rows may see (``j <= i``). One tile, the whole block, when the scores fit."""
    rows = max(1, budget // max(1, b * h * sk))
    if rows >= sq:
        return [(slice(0, sq), slice(0, sk))]
    return [(slice(a, min(sq, a + rows)), slice(0, min(sk, a + rows) if causal else sk)) for a in range(0, sq, rows)]


def hidden_pairs(causal: bool, mask, rows: slice, keys: slice, device) -> torch.Tensor | None:
    """Bool ``[rows, keys]``: the pairs of a tile that are hidden (top-left causal: key j > query i, in the block's
    row numbering; or not allowed by ``mask``, a :class:`~megatron_ring.schedules.masks.BlockMask`); None: none."""
    hidden = None
    if causal:
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        hidden = torch.arange(keys.start, keys.stop, device=device)[None, :] > i
    if mask is not None:
        off = ~mask.allowed(device, rows=rows, keys=keys)
        hidden = off if hidden is None else hidden | off
    return hidden


class RowTiled(BlockKernel):
    """A kernel that materialises fp32 scores, run in tiles of query rows (:func:`row_tiles`): exact, rows are
    independent; the backward sums dK/dV over the tiles in fp32. A subclass gives ``_tile_forward`` (fp32 out, lse)
    and ``_tile_backward`` (fp32 dq, dk, dv) of one tile; ``rows``/``keys`` place it in the block (its causal
    offset, its share of the mask and of per-row extras such as positions)."""

    supports_mask = True
    #: elements of one fp32 score tensor per tile (:data:`SCORE_BUDGET`; tests set a small one)
    score_budget = SCORE_BUDGET

    def unsupported_head_dims(self, q, k, v):
        return None  # scores from Q and K, outputs from V: any head dims

    def _tiles(self, q, k, causal):
        b, h, sq, _ = q.shape
        return row_tiles(b, h, sq, k.shape[2], causal, self.score_budget)

    def forward(self, q, k, v, causal, scale, mask=None, **extra):
        tiles = self._tiles(q, k, causal)
        if len(tiles) == 1:
            out, lse = self._tile_forward(q, k, v, causal, scale, mask, *tiles[0], **extra)
            return out.to(q.dtype), lse
        b, h, sq, _ = q.shape
        out = q.new_empty((b, h, sq, v.shape[-1]))
        lse = q.new_empty((b, h, sq), dtype=torch.float32)
        for rows, keys in tiles:
            o, l_ = self._tile_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale, mask, rows, keys,
                                       **extra)
            out[:, :, rows] = o
            lse[:, :, rows] = l_
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, **extra):
        tiles = self._tiles(q, k, causal)
        if len(tiles) == 1:
            dq, dk, dv = self._tile_backward(dout, q, k, v, out, lse, causal, scale, mask, *tiles[0], **extra)
        else:
            dq = q.new_empty(q.shape)
            dk = k.new_zeros(k.shape, dtype=torch.float32)
            dv = v.new_zeros(v.shape, dtype=torch.float32)
            for rows, keys in tiles:
                tq, tk, tv = self._tile_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                                 out[:, :, rows], lse[:, :, rows], causal, scale, mask, rows, keys,
                                                 **extra)
                dq[:, :, rows] = tq
                dk[:, :, keys] += tk
                dv[:, :, keys] += tv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @abc.abstractmethod
    def _tile_forward(self, q, k, v, causal, scale, mask, rows, keys, **extra):
        """(out fp32 or q's dtype, lse fp32) of the tile's rows against its keys."""

    @abc.abstractmethod
    def _tile_backward(self, dout, q, k, v, out, lse, causal, scale, mask, rows, keys, **extra):
        """(dq, dk, dv) in fp32 of the tile."""


class MathKernel(RowTiled):
    """Plain fp32 matmul/softmax. Slow, exact, works on every device and dtype; blocks whose scores exceed
    :data:`SCORE_BUDGET` elements run in tiles of query rows."""

    name = "math"

    @staticmethod
    def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
        b, h, s, d = q.shape
        return q.reshape(b, h_kv, h // h_kv, s, d)

    @staticmethod
    def _scores(q, k, causal, scale, mask, rows, keys) -> torch.Tensor:
        qg = MathKernel._grouped(q.float(), k.shape[1])
        s = torch.einsum("bkgqd,bksd->bkgqs", qg, k.float()).mul_(scale)
        hidden = hidden_pairs(causal, mask, rows, keys, q.device)
        return s if hidden is None else s.masked_fill_(hidden, float("-inf"))

    def _tile_forward(self, q, k, v, causal, scale, mask, rows, keys):
        s = self._scores(q, k, causal, scale, mask, rows, keys)
        lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(_finite_lse(lse).unsqueeze(-1)).exp_()  # in place (one score tensor); rows with no key: zeros
        out = torch.einsum("bkgqs,bksd->bkgqd", p, v.float())
        b, h, sq, d = q.shape
        return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)

    def _tile_backward(self, dout, q, k, v, out, lse, causal, scale, mask, rows, keys):
        h_kv = k.shape[1]
        p = self._scores(q, k, causal, scale, mask, rows, keys)
        p.sub_(self._grouped(_finite_lse(lse).unsqueeze(-1), h_kv)).exp_()  # in place: two score tensors at most
        do = self._grouped(dout.float(), h_kv)
        delta = (do * self._grouped(out.float(), h_kv)).sum(-1, keepdim=True)
        dv = torch.einsum("bkgqs,bkgqd->bksd", p, do)
        ds = torch.einsum("bkgqd,bksd->bkgqs", do, v.float()).sub_(delta).mul_(p).mul_(scale)
        dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k.float()).reshape(q.shape)
        dk = torch.einsum("bkgqs,bkgqd->bksd", ds, self._grouped(q.float(), h_kv))
        return dq, dk, dv
