"""Workers for tests/megatron/test_mtp_cp_invariant.py: Megatron's MTP token count at CP > 1."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def mtp_count_worker(rank: int, world: int, seq: int) -> dict[str, Any]:
    """A loss mask (2 x ``seq``, ~20 % masked) split zigzag the way Megatron splits a batch (chunks r and
    2P-1-r); Megatron's ``roll_tensor`` on this rank's share, before and after ``cp_invariant_mtp_loss``.
    Returns the counts, the whole sequence's rolled count, and whether the rolled tensors are the zigzag
    share of the whole sequence's roll (the wrapper must leave them as they are)."""
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # roll_tensor allocates its receive buffers there (CPU lab only)
    import megatron.core.transformer.multi_token_prediction as M

    from megatron_ring.megatron import cp_invariant_mtp_loss

    mask = (torch.rand(2, seq, generator=torch.Generator().manual_seed(0)) > 0.2).float()
    chunks = mask.chunk(2 * world, dim=-1)
    local = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=-1)
    whole = torch.roll(mask, -1, -1)
    whole[..., -1] = 0
    w_chunks = whole.chunk(2 * world, dim=-1)
    want_rolled = torch.cat([w_chunks[rank], w_chunks[2 * world - 1 - rank]], dim=-1)
    group = dist.new_group(list(range(world)))

    megatron_rolled, megatron_count = M.roll_tensor(local, -1, -1, group)
    wrapped = cp_invariant_mtp_loss()
    again = cp_invariant_mtp_loss()  # idempotent: no second wrapper
    rolled, count = M.roll_tensor(local, -1, -1, group)
    cp1_rolled, cp1_count = M.roll_tensor(mask, -1, -1, None)  # CP=1 (no group): untouched
    return {"megatron": float(megatron_count), "exact": float(count), "whole": float(whole.sum()),
            "megatron_rolled_ok": torch.equal(megatron_rolled, want_rolled), "rolled_ok": torch.equal(rolled, want_rolled),
            "cp1_ok": torch.equal(cp1_rolled, whole) and float(cp1_count) == float(whole.sum()),
            "wrapped": wrapped, "idempotent": again == wrapped and M.roll_tensor.__wrapped__.__name__ == "roll_tensor"
            and not getattr(M.roll_tensor.__wrapped__, "_megatron_ring", False)}
