"""Our scheduler at the seam of Megatron's hybrid-CP data path: ``RingCPScheduler`` answers
``BalancedCPScheduler.get_groups_and_subsamples`` in the same shape, with only groups megatron-core's
``parallel_state`` builds (aligned powers of two), every document once, and is never predicted slower."""
import random

import pytest

hcs = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule",
                          reason="this megatron-core has no hybrid-CP scheduler")

from megatron_ring.megatron.groups.dynamic_cp import RingCPScheduler  # noqa: E402
from megatron_ring.planning import dynamic_cp as dc  # noqa: E402


class _Group:  # what both schedulers read of the DP x CP group
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def _consumer_view(groups, id_groups, id_lens, world):
    """What Megatron's hybrid-CP forward/backward loop derives: per round, each id's ranks (its CP size
    is their count, its group the aligned block of that size around each of them)."""
    seen = []
    for lens_r, ids_r in zip(groups, id_groups):
        assert len(lens_r) == len(ids_r) == world
        where = {}
        for r in range(world):
            assert [id_lens[i] for i in ids_r[r]] == lens_r[r]
            for i in ids_r[r]:
                where.setdefault(i, []).append(r)
        for i, ranks in where.items():
            p = len(ranks)
            assert p & (p - 1) == 0 or p == world
            assert ranks == list(range(ranks[0], ranks[0] + p)) and ranks[0] % p == 0
            # the ranks sharing a document run the documents they share in the same order
            for r in ranks[1:]:
                shared = [x for x in ids_r[r] if x in set(ids_r[ranks[0]])]
                assert shared == [x for x in ids_r[ranks[0]] if x in set(ids_r[r])]
        seen += list(where)
    return sorted(seen)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_scheduler_answers_megatrons_call(world):
    rnd = random.Random(world)
    lens = [rnd.randint(200, 4000) for _ in range(30)] + [rnd.randint(9000, 16000) for _ in range(3)]
    sample_id_seqlens = [(i, n) for i, n in enumerate(lens)]
    cap = 8192
    ours = RingCPScheduler(cap, _Group(world))
    g, ig = ours.get_groups_and_subsamples(list(sample_id_seqlens), None)
    assert _consumer_view(g, ig, dict(sample_id_seqlens), world) == list(range(len(lens)))
    meg = hcs.BalancedCPScheduler(cap, _Group(world))
    mg, mig = meg.get_groups_and_subsamples(list(sample_id_seqlens), None)
    assert _consumer_view(mg, mig, dict(sample_id_seqlens), world) == list(range(len(lens)))
    # by the cost model, ours is never slower than our implementation of Megatron's policy
    base = dc.schedule_megatron_balanced(lens, world, ours.problem, ours.machine, max_tokens_per_rank=cap)
    assert ours.last_schedule.step_s <= base.step_s * (1 + 1e-9)
