"""``DocumentZigzag``: the per-document zigzag THD order (Megatron-Core / TransformerEngine's) as a ring layout.

Its positions are checked against an independent construction (chunks r and 2P-1-r of every padded
document, in document order) for P = 1..8, and ring attention run in that order (p2p, all_gather, a2a, auto)
matches the float64 per-document reference, outputs AND dq/dk/dv, for random document mixes (lengths
padded to multiples of 2P, filler after each document as its own document, empty documents), causal and
not, and without documents (the global causal mask over those positions). Tolerances as tests/test_documents.py.
"""
import random

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import Checks
from megatron_ring import DocumentZigzag
from tests.test_documents import _case


def padded_mix(world, seed, docs=4):
    """(cu_seqlens_padded, cu for the ring: real tokens, then each filler run as a document of its own)."""
    rnd = random.Random(seed)
    lens = [rnd.choice([0, 1, 2, 3, 5, 7, 11, 2 * world + 1]) for _ in range(docs)]
    pad = [-(-n // (2 * world)) * 2 * world for n in lens]
    if not sum(pad):
        lens[0], pad[0] = 1, 2 * world
    cu_pad, ring_cu = [0], [0]
    for n, p in zip(lens, pad):
        ring_cu += [cu_pad[-1] + n, cu_pad[-1] + p]
        cu_pad.append(cu_pad[-1] + p)
    ring_cu = sorted(set(ring_cu))
    return cu_pad, ring_cu


@pytest.mark.parametrize("world", range(1, 9))
def test_positions_are_per_document_zigzag(world):
    for seed in range(20):
        cu, _ = padded_mix(world, seed)
        lay = DocumentZigzag(cu)
        owner = {}
        for r in range(world):
            want = []
            for a, b in zip(cu, cu[1:]):
                chunks = [list(range(a + i * (b - a) // (2 * world), a + (i + 1) * (b - a) // (2 * world)))
                          for i in range(2 * world)]
                want += chunks[r] + chunks[2 * world - 1 - r]
            got = lay.positions(cu[-1], world, r).tolist()
            assert got == want, (world, cu, r)
            owner.update({p: r for p in got})
        assert sorted(owner) == list(range(cu[-1]))  # a partition of the stream
    with pytest.raises(ValueError, match="multiple of 2 x 2"):
        DocumentZigzag([0, 6, 10]).positions(10, 2, 0)


def _worker(rank, world):
    rows = []
    for i in range(4):
        cu_pad, ring_cu = padded_mix(world, 100 + i)
        lay = DocumentZigzag(cu_pad)
        causal = i % 2 == 0
        for ct in ("p2p", "all_gather", "a2a", "auto"):
            for what, err, bound in _case(world, lay, causal, "per-document zigzag", cu_pad[-1], ring_cu, None,
                                          (4, 2), torch.float32, "auto", seed=i, comm_type=ct):
                rows.append(((ct, cu_pad, causal, what), err, bound))
    cu_pad, _ = padded_mix(world, 7)  # no documents given: the global causal mask over these positions
    for what, err, bound in _case(world, DocumentZigzag(cu_pad), True, "global causal", cu_pad[-1], None, None,
                                  (4, 4), torch.float32, "auto", seed=9):
        rows.append((("p2p", cu_pad, True, what), err, bound))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_in_per_document_zigzag_order(world):
    checks = Checks(f"document zigzag P={world}")
    for rows in run_distributed(_worker, world, timeout=300):
        checks.extend(rows)
    checks.check(min_rows=world * (4 * 4 + 1) * 4)
