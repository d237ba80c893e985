"""A travelling block streamed in pieces through ``n + 1`` equal slots (sub-block streaming).

A ring step sends the visiting block to the next rank and receives the next block from the previous
one. Whole-block double buffering holds two blocks per stream. Here a block is ``n`` pieces (groups of
K/V heads) in ``n + 1`` slots: piece ``j`` of the next block is received into the one free slot, and
the slot piece ``j`` of the current block leaves once its send is done becomes the free slot for piece
``j + 1``. The exchanges form one chain, each started after the previous one has finished (and after
the compute that reads the slot it overwrites); a stream then costs ``(n + 1) / n`` blocks, not 2.

Slot bookkeeping: with the current block's pieces in slots ``a, a+1, .., a+n-1`` (mod ``n + 1``), the
next block's land in ``a-1, a, .., a+n-2``: one position back per step. :func:`start_for` picks the
first position so that after a known number of steps the pieces sit in slots ``0..n-1`` in order
(the dK/dV accumulators then ARE the returned gradients, without a copy).
"""
from __future__ import annotations

import math

import torch

from megatron_ring import breakdown
from megatron_ring.transport.ring import Exchange, Ring

__all__ = ["Rotation", "start_for", "piece_count", "AUTO_PIECES_CPU", "CPU_MIN_PIECE_WORK", "CUDA_MIN_TILES"]

#: automatic pieces on CPU: at most this many
AUTO_PIECES_CPU = 8
#: on CPU a piece keeps at least this much work per ring step (batch x query heads x local length^2 x
#: head dim; about 0.3 s forward + 0.7 s backward on one core of the CI machine): every piece costs three
#: exchanges per step (K/V forward; K/V and dK/dV backward), each a rendezvous with both neighbours that
#: costs 2-3 ms of the rank's CPU on gloo (measured: S=8192 causal, 8 pieces against 1 took 1.18x the CPU
#: at P=4 (2^28 work per piece), 1.06x at P=2 (2^30)), which the compute sharing that core cannot hide;
#: 2^32 keeps it under 1% (docs/performance.md)
CPU_MIN_PIECE_WORK = 2**32
#: on CUDA a piece keeps at least this many (query head x 128-row) kernel tiles (about four waves
#: of a 132-SM GPU), so pieces never starve the device
CUDA_MIN_TILES = 528


def piece_count(b: int, h: int, h_kv: int, s: int, d: int, device_type: str, requested: int | None = None) -> int:
    """The most pieces a ring over ``[b, h_kv, s, d]`` K/V (``h`` query heads, ``s`` the local length)
    may stream a block in (the engine uses the largest divisor of the head count it sees that is not
    above it).

    ``requested``: that many at most (``ring_attention`` passes ``MEGATRON_RING_KV_PIECES`` here when its
    argument is None). Automatic: on CPU up to
    :data:`AUTO_PIECES_CPU`, as many as keep :data:`CPU_MIN_PIECE_WORK` per piece; on CUDA as many as
    keep :data:`CUDA_MIN_TILES` tiles per piece.
    The result depends on shapes and the device type only, so every rank of a ring gets the same."""
    if requested is not None:
        return min(_positive(requested, "kv_pieces"), max(h_kv, 1))
    if device_type == "cuda":
        tiles = b * h * math.ceil(s / 128)
        return max(1, min(h_kv, tiles // CUDA_MIN_TILES))
    return max(1, min(h_kv, AUTO_PIECES_CPU, b * h * s * s * d // CPU_MIN_PIECE_WORK))


def _positive(value, name: str) -> int:
    """``value`` (an int, or the text of one) if it is a positive integer, else a ValueError naming ``name``."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (K/V pieces per ring step), got {value!r}")
    return value


def divisor_at_most(h: int, n: int) -> int:
    """The largest divisor of ``h`` that is ``<= n`` (pieces of equal size)."""
    return max(d for d in range(1, max(1, min(h, n)) + 1) if h % d == 0)


def start_for(n: int, steps: int) -> int:
    """The first slot of piece 0 such that after ``steps`` steps the pieces sit in slots ``0..n-1``."""
    return steps % (n + 1)


class Rotation:
    """``n`` pieces of the current block and the next one's arrivals, in ``slots`` (``n + 1`` tensors of
    the same size, or views of them)."""

    def __init__(self, ring: Ring, slots: list[torch.Tensor], channel: str, start: int = 0) -> None:
        self.ring, self.slots, self.channel = ring, slots, channel
        self.n = len(slots) - 1
        self.cur = [(start + j) % (self.n + 1) for j in range(self.n)]
        self.nxt = list(self.cur)
        self.spare = (start + self.n) % (self.n + 1)
        self.last: Exchange | None = None  # the chain's newest exchange
        self.arriving: list[Exchange | None] = [None] * self.n  # delivered the current block's pieces
        self.incoming: list[Exchange | None] = [None] * self.n  # deliver the next block's pieces

    def piece(self, j: int) -> torch.Tensor:
        """The slot holding piece ``j`` of the current block."""
        return self.slots[self.cur[j]]

    def pass_on(self, j: int, step: int) -> None:
        """Send piece ``j`` of the current block on and receive the next block's piece ``j`` (after the
        chain's previous exchange: its send freed the slot this one receives into)."""
        wait(self.last, step)
        ex = self.ring.exchange(self.slots[self.cur[j]], self.slots[self.spare], self.channel, step)
        self.nxt[j], self.spare = self.spare, self.cur[j]
        self.incoming[j] = self.last = ex

    def arrived(self, j: int, step: int) -> None:
        """Wait until piece ``j`` of the current block is here."""
        wait(self.arriving[j], step)
        self.arriving[j] = None

    def advance(self) -> None:
        """The next block becomes the current one."""
        self.cur, self.arriving = list(self.nxt), self.incoming
        self.incoming = [None] * self.n

    def drain(self, step: int) -> None:
        """Wait for what is in flight (the ring is over): only the chain's newest exchange can be, as each
        one is started after its predecessor finished."""
        wait(self.last, step)
        self.last = None


def wait(ex: Exchange | None, step: int) -> None:
    if ex is not None:
        with breakdown.section(step, "wait"):
            ex.wait()
