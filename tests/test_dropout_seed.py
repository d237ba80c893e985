"""The attention-dropout seed as a device tensor (docs/cuda_graphs.md row 8): the same keep mask, the same
outputs and gradients as the int seed of the same 64-bit value, with no host read of the seed."""
from __future__ import annotations

import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.kernels.dropout import keep_mask
from megatron_ring.transport.ring import LoopbackRing

SEEDS = [0, 1, 7, 1234, 2 ** 32 - 1, 2 ** 32, 2 ** 62 + 5, 2 ** 63 - 1, -1, -(2 ** 63), -987654321987]


@pytest.mark.parametrize("seed", SEEDS)
def test_keep_mask_of_a_tensor_seed_is_the_int_seeds(seed):
    pos = torch.arange(64)
    rows = torch.arange(6)
    want = keep_mask(seed, rows, pos, pos, 0.3)
    got = keep_mask(torch.tensor(seed, dtype=torch.int64), rows, pos, pos, 0.3)
    assert torch.equal(got, want)
    assert 0.2 < 1 - want.float().mean().item() < 0.4  # the mask drops (a constant mask would pass equality)
    other = keep_mask(torch.tensor(seed ^ 1, dtype=torch.int64), rows, pos, pos, 0.3)
    assert not torch.equal(other, want)  # and the seed matters


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("seed", [3, 2 ** 62 + 11])
def test_ring_attention_with_a_tensor_seed_is_bit_identical_to_the_int_seed(P, seed):
    g = torch.Generator().manual_seed(P)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g) for _ in range(3))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()  # GQA
    dout = torch.randn(2, 16, 4, 8, generator=g)

    def run(s):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*leaves, causal=True, dropout_p=0.2, dropout_seed=s,
                             ring=LoopbackRing(P, P // 2, q.device))
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    want = run(seed)
    got = run(torch.tensor(seed))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dropout_seed"):
        ring_attention(q, k, v, causal=True, dropout_p=0.2, dropout_seed=torch.tensor([1.5]))


def test_glue_row_seeds_on_the_device_equal_the_python_formula():
    pytest.importorskip("megatron.core")
    from megatron_ring.megatron.attention.dropout import row_seed

    mix = 0x9E3779B97F4A7C15
    g = torch.Generator().manual_seed(0)
    bases = [0, 1, 2 ** 62 - 1, 2 ** 62, 2 ** 63 - 1] + torch.randint(0, 2 ** 62, (20,), generator=g).tolist() \
        + [b + 2 ** 62 for b in torch.randint(0, 2 ** 62, (20,), generator=g).tolist()]
    for base in bases:
        for row in range(5):
            got = row_seed(torch.tensor(base, dtype=torch.int64), row)
            assert int(got) == (base + mix * (row + 1)) % (1 << 63), (base, row)


def _seed_worker(rank: int, world: int, variant: str) -> str:
    from megatron_ring import ring_attention

    q = torch.randn(1, 4, 2, 8)
    kw = {"p": dict(dropout_p=0.1, dropout_seed=7) if rank == 0 else {},  # one rank in eval mode: dropout off
          "kind": dict(dropout_p=0.1, dropout_seed=7 if rank == 0 else torch.tensor([7])),
          "same": dict(dropout_p=0.1, dropout_seed=7)}[variant]
    try:
        ring_attention(q, q, q, timeout_s=20.0, **kw)
        return "ran"
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.mark.slow
@pytest.mark.parametrize("variant,named", [("p", "dropout/softmax_offset/kv_pieces"), ("kind", "int dropout_seed given")])
def test_ranks_that_disagree_on_dropout_are_named_on_every_rank(variant, named):
    """dropout_p on one rank only, or an int seed beside a tensor seed: the cross-rank check names the difference
    on every rank (its all-gather sent tensors of different sizes: gloo aborted the processes, NCCL could hang).
    Control: the same arguments run."""
    from tests.helpers.launch import run_distributed

    for r in run_distributed(_seed_worker, 2, variant, timeout=120):
        assert r.startswith("ValueError: ring_attention was called with different arguments") and named in r, r
    assert run_distributed(_seed_worker, 2, "same", timeout=120) == ["ran", "ran"]
