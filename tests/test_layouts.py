"""Every layout's block-task schedule reproduces the global causal mask exactly."""
import pytest
import torch

from megatron_ring.schedules.layouts import LAYOUTS, get_layout


def task_mask(tasks, s):
    """The [s, s] visibility mask a task list computes (counting overlaps, to catch double work)."""
    m = torch.zeros(s, s, dtype=torch.int64)
    for t in tasks:
        rows = torch.arange(s)[t.q]
        cols = torch.arange(s)[t.kv]
        sub = torch.ones(len(rows), len(cols), dtype=torch.int64)
        if t.causal:
            assert len(rows) == len(cols), "causal tasks must be square (kernel-alignment independent)"
            sub = sub.tril()
        m[rows[:, None], cols[None, :]] += sub
    return m


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_tasks_match_global_mask(name, world, causal):
    lay = get_layout(name)
    for s in (2, 6, 8):
        seq = s * world
        pos = [lay.positions(seq, world, r) for r in range(world)]
        assert sorted(torch.cat(pos).tolist()) == list(range(seq)), "positions must partition the sequence"
        for rank in range(world):
            for src in range(world):
                tasks = lay.block_tasks(causal, world, rank, src, s)
                want = (pos[rank][:, None] >= pos[src][None, :]) if causal else torch.ones(s, s, dtype=torch.bool)
                got = task_mask(tasks, s)
                assert got.max() <= 1, f"{name} computes some pairs twice"
                assert torch.equal(got.bool(), want), f"{name} P={world} r={rank} src={src} s={s}"
                for t in tasks:  # no fully masked query row inside a task
                    sub = want[t.q][:, t.kv]
                    assert sub.any(dim=1).all(), f"{name}: task {t} has a fully masked row"


def test_zigzag_and_striped_balance_causal_work():
    world, s = 4, 32
    for name in ("zigzag", "striped"):
        lay = get_layout(name)
        work = [sum(task_mask(lay.block_tasks(True, world, r, src, s), s).sum().item() for src in range(world))
                for r in range(world)]
        assert max(work) <= 1.15 * min(work), f"{name} is unbalanced: {work}"
    contig = get_layout("contiguous")
    work = [sum(task_mask(contig.block_tasks(True, world, r, src, s), s).sum().item() for src in range(world))
            for r in range(world)]
    assert max(work) > 3 * min(work)  # the imbalance zigzag/striped exist to fix


def test_bad_layout_and_lengths():
    with pytest.raises(ValueError, match="unknown layout"):
        get_layout("spiral")
    with pytest.raises(ValueError, match="multiple of 2"):
        get_layout("zigzag").check_local_len(7, 4)
    with pytest.raises(ValueError, match="divisible by 8"):
        get_layout("zigzag").check_global_len(12, 4)
    get_layout("striped").check_local_len(7, 4)
