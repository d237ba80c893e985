"""shard_sequence / gather_sequence round trips and gradients for every layout."""
import pytest
import torch

from tests.helpers.launch import run_distributed
from megatron_ring import gather_sequence, shard_sequence
from megatron_ring.schedules.layouts import LAYOUTS


def _roundtrip_worker(rank, world, layout):
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).view(2, 4 * world, 3)
    local = shard_sequence(x, 1, layout=layout).requires_grad_()
    full = gather_sequence(local, 1, layout=layout)
    assert torch.equal(full, x)
    (full * (torch.arange(full.numel(), dtype=torch.float64).view_as(full))).sum().backward()
    weights = torch.arange(x.numel(), dtype=torch.float64).view_as(x)
    assert torch.equal(local.grad, shard_sequence(weights, 1, layout=layout))
    local.grad = None
    full = gather_sequence(local, 1, layout=layout, sum_grads=True)
    full.sum().backward()
    assert torch.equal(local.grad, torch.full_like(local, float(world)))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_gather_roundtrip(layout):
    assert all(run_distributed(_roundtrip_worker, 3, layout, timeout=120))


def test_single_process_shard_is_identity_and_checks_length():
    x = torch.randn(2, 6, 3)
    assert torch.equal(shard_sequence(x, 1), x)
    assert gather_sequence(x, 1) is x
    with pytest.raises(ValueError, match="divisible by 2"):
        shard_sequence(torch.randn(2, 5, 3), 1, layout="zigzag")
