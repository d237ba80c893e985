"""Dynamic CP scheduler (megatron_ring/planning/dynamic_cp.py): every document placed once, the
schedule's balance within its own prediction, never predicted slower than fixed CP, determinism, the
Megatron-policy baseline, and the per-rank causal work against a brute-force count."""
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers.numerics import F64_REL
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.planning import dynamic_cp as dc
from megatron_ring.planning.cost_model import Machine, Problem

PB = Problem(batch=1, seq=0, heads=8, kv_heads=4, head_dim=64, layout="zigzag", elem_bytes=2)
GPU = Machine(flops=400e12, bw_intra=300e9, latency=20e-6, call_overhead=20e-6)
CPU = Machine(flops=20e9, bw_intra=2e9, latency=100e-6, call_overhead=1e-4, overlap=0.0)


def long_tail(n: int, seed: int, scale: int = 1) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randint(500, 4000) // scale for _ in range(n)] + [rnd.randint(32000, 64000) // scale
                                                                    for _ in range(max(1, n // 20))]


def _placed(s: dc.DynamicCPSchedule) -> list[int]:
    return sorted(d for sub in s.subsamples for d in sub.docs)


def _check_schedule(s: dc.DynamicCPSchedule, lens: list[int], world: int, cap: int | None, layout: str = "zigzag") -> None:
    assert _placed(s) == [d for d, n in enumerate(lens) if n > 0]  # every document exactly once
    need = get_layout(layout).local_multiple()
    for rnd in s.rounds:
        for sub in rnd:
            assert sub.ranks == tuple(range(sub.ranks[0], sub.ranks[0] + sub.size))  # consecutive ranks
            assert 0 <= sub.ranks[0] and sub.ranks[-1] < world
            assert sub.lengths == tuple(lens[d] for d in sub.docs)
            assert sub.padded >= sum(sub.lengths) and sub.padded % (need * sub.size) == 0
            assert sub.padded - sum(sub.lengths) < need * sub.size or sum(sub.lengths) < need * sub.size
            if cap is not None:
                assert sub.padded // sub.size <= cap
    # the prediction is the schedule's own: per round, every rank runs its sub-samples in list order and
    # one starts when its last rank is free (an event simulation, written here independently); rounds add
    step = 0.0
    busy = [0.0] * world
    for rnd in s.rounds:
        pending = {r: [i for i, sub in enumerate(rnd) if r in sub.ranks] for r in range(world)}
        done_at: dict[int, float] = {}
        clock = [0.0] * world
        while any(pending.values()):
            ready = [i for i in {q[0] for q in pending.values() if q}
                     if all(pending[r] and pending[r][0] == i for r in rnd[i].ranks)]
            assert ready, "deadlock: no sub-sample has all its ranks at its turn"
            i = min(ready)
            start = max(clock[r] for r in rnd[i].ranks)
            for r in rnd[i].ranks:
                clock[r] = start + rnd[i].predicted_s
                busy[r] += rnd[i].predicted_s
                pending[r].pop(0)
            done_at[i] = start + rnd[i].predicted_s
        step += max(clock)
    assert s.step_s == pytest.approx(step, rel=F64_REL)
    assert list(s.rank_s) == pytest.approx(busy, rel=F64_REL)
    assert max(s.rank_s) <= s.step_s * (1 + F64_REL)
    assert s.imbalance >= 1 - F64_REL


def _check_balance(s: dc.DynamicCPSchedule) -> None:
    """Work balance within the schedule's own prediction: the slowest rank exceeds the mean busy time by
    less than the longest sub-sample of each round (the list-scheduling bound)."""
    mean = sum(s.rank_s) / s.world
    slack = sum(max(x.predicted_s for x in rnd) for rnd in s.rounds if rnd)
    assert s.step_s <= mean + slack * (1 + F64_REL)


def test_causal_pairs_closed_form_matches_brute_force():
    rnd = random.Random(3)
    for layout in ("zigzag", "striped", "contiguous"):
        lay = get_layout(layout)
        for p in (1, 2, 3, 4, 5):
            for _ in range(15):
                lens = [rnd.randint(0, 40) for _ in range(rnd.randint(1, 5))]
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + n)
                padded = dc.padded_length(cu[-1] + rnd.randint(0, 5), p, layout)
                pos = torch.arange(padded)
                doc = torch.tensor([next((i for i in range(len(lens)) if cu[i] <= q < cu[i + 1]), -1)
                                    for q in range(padded)])
                ok = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & (pos[None, :] <= pos[:, None])
                ref = [int(ok[lay.positions(padded, p, r)].sum()) for r in range(p)]
                assert dc._causal_pairs_per_rank(lay, cu, padded, p) == ref


def test_padding_rule_per_layout():
    assert dc.padded_length(10, 3, "zigzag") == 12 and dc.padded_length(10, 3, "striped") == 12
    assert dc.padded_length(13, 3, "zigzag") == 18 and dc.padded_length(13, 3, "striped") == 15
    assert dc.padded_length(0, 4, "zigzag") == 8


@pytest.mark.parametrize("world", [1, 3, 4, 6, 8])
@pytest.mark.parametrize("machine", [GPU, CPU], ids=["gpu", "cpu"])
def test_schedule_places_every_document_once_and_beats_fixed_cp(world, machine):
    lens = long_tail(40, seed=world)
    cap = 64000 // min(world, 2) + 64
    ours = dc.schedule_dynamic_cp(lens, world, PB, machine, max_tokens_per_rank=cap)
    _check_schedule(ours, lens, world, cap)
    _check_balance(ours)
    fixed = []
    for cp in range(1, world + 1):
        if world % cp:
            continue
        try:
            f = dc.schedule_fixed_cp(lens, world, cp, PB, machine, max_tokens_per_rank=cap)
        except ValueError:
            continue
        _check_schedule(f, lens, world, cap)
        fixed.append(f.step_s)
    assert fixed and ours.step_s <= min(fixed) * (1 + F64_REL)  # never predicted slower than a fixed CP size
    meg = dc.schedule_megatron_balanced(lens, world, PB, machine, max_tokens_per_rank=cap)
    _check_schedule(meg, lens, world, cap)
    assert ours.step_s <= meg.step_s * (1 + F64_REL)  # never predicted slower than Megatron's policy


def test_non_power_of_two_groups_and_pow2_restriction():
    lens = [30000, 30000, 30000] + [800] * 30
    any_ = dc.schedule_dynamic_cp(lens, 6, PB, GPU, max_tokens_per_rank=16384)
    pow2 = dc.schedule_dynamic_cp(lens, 6, PB, GPU, max_tokens_per_rank=16384, sizes="pow2")
    assert {s.size for s in pow2.subsamples} <= {1, 2, 4, 6}  # Megatron builds 2^k groups and all ranks
    assert any_.step_s <= pow2.step_s * (1 + F64_REL)
    _check_schedule(any_, lens, 6, 16384)
    _check_schedule(pow2, lens, 6, 16384)


def test_deterministic_for_batch_and_seed():
    lens = [1000] * 12 + [2000] * 6 + [40000]
    a = dc.schedule_dynamic_cp(lens, 4, PB, GPU, max_tokens_per_rank=32768, seed=5)
    b = dc.schedule_dynamic_cp(list(lens), 4, PB, GPU, max_tokens_per_rank=32768, seed=5)
    assert a == b
    c = dc.schedule_dynamic_cp(lens, 4, PB, GPU, max_tokens_per_rank=32768, seed=6)
    assert c.step_s == pytest.approx(a.step_s, rel=F64_REL)  # equal lengths may swap, the prediction cannot
    _check_schedule(c, lens, 4, 32768)


def test_cost_prefers_cheap_groups_for_short_documents():
    cost = dc.PackCost(PB, GPU)
    # a short document alone: on 4 GPUs it pays exchange latency for a tiny compute share
    assert cost([1024], 1)["time_s"] < cost([1024], 4)["time_s"]
    # a long one: splitting the quadratic work wins
    assert cost([65536], 4)["time_s"] < cost([65536], 1)["time_s"]
    # documents cost less than one causal sequence of the same tokens (the document mask)
    assert cost([8192] * 8, 2)["compute_s"] < 0.2 * cost([65536], 2)["compute_s"]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="raise max_tokens_per_rank"):
        dc.schedule_dynamic_cp([100000], 4, PB, GPU, max_tokens_per_rank=1000)
    with pytest.raises(ValueError, match="must divide"):
        dc.schedule_fixed_cp([10], 4, 3, PB, GPU)
    with pytest.raises(ValueError, match=">= 0"):
        dc.schedule_dynamic_cp([-1], 4, PB, GPU)
    assert dc.schedule_dynamic_cp([], 4, PB, GPU).subsamples == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 20000), min_size=1, max_size=30), world=st.integers(1, 6),
       seed=st.integers(0, 3), layout=st.sampled_from(["zigzag", "striped", "contiguous"]),
       machine=st.sampled_from([GPU, CPU]))
# found by the property in CI: a baseline 2.6e-12 faster than the dynamic schedule was not taken (the old 1e-9
# margin on baselines); the scheduler now takes a baseline whenever it is faster
@example(lens=[2, 10033, 10032, 1], world=1, seed=0, layout="zigzag", machine=CPU)
def test_property_random_length_mixes(lens, world, seed, layout, machine):
    pb = Problem(batch=1, seq=0, heads=4, kv_heads=2, head_dim=32, layout=layout)
    cap = 20000 + 64
    ours = dc.schedule_dynamic_cp(lens, world, pb, machine, max_tokens_per_rank=cap, seed=seed)
    _check_schedule(ours, lens, world, cap, layout)
    _check_balance(ours)
    assert ours == dc.schedule_dynamic_cp(lens, world, pb, machine, max_tokens_per_rank=cap, seed=seed)
    for cp in (1, world):
        f = dc.schedule_fixed_cp(lens, world, cp, pb, machine, max_tokens_per_rank=cap)
        assert ours.step_s <= f.step_s * (1 + F64_REL)
    meg = dc.schedule_megatron_balanced(lens, world, pb, machine, max_tokens_per_rank=cap)
    _check_schedule(meg, lens, world, cap, layout)


def test_aligned_pow2_groups_are_megatrons_hybrid_groups():
    lens = long_tail(60, seed=9)
    s = dc.schedule_dynamic_cp(lens, 8, PB, GPU, max_tokens_per_rank=32768, sizes="pow2", aligned=True)
    _check_schedule(s, lens, 8, 32768)
    for sub in s.subsamples:
        assert sub.size in (1, 2, 4, 8) and sub.ranks[0] % sub.size == 0


def test_length_mixes_are_seeded_and_shaped():
    from megatron_ring_lab.dynamic_plan import doc_lengths

    a = doc_lengths("long-tail", 100, seed=1)
    assert a == doc_lengths("long-tail", 100, seed=1) and a != doc_lengths("long-tail", 100, seed=2)
    assert sum(n >= 32768 for n in a) == 4 and all(512 <= n <= 4096 for n in a if n < 32768)
    u = doc_lengths("uniform", 50, seed=0, scale=16)
    assert all(32 <= n <= 4096 for n in u)
    with pytest.raises(ValueError, match="unknown mix"):
        doc_lengths("zipf", 3)


def test_planner_dynamic_cp_subcommand(tmp_path, capsys):
    import json

    from megatron_ring_lab import planner

    lens = tmp_path / "lens.txt"
    lens.write_text("# a global batch\n30000, 28000\n" + " ".join(["900"] * 40) + "\n")
    out = tmp_path / "plan.json"
    rows = planner.main(["dynamic-cp", "--lengths-file", str(lens), "--world-sizes", "4", "--max-tokens-per-rank",
                         "16384", "--json", str(out)])
    text = capsys.readouterr().out
    assert "Megatron balanced" in text and "fixed CP=4 DP=1" in text and "ours" in text
    saved = json.loads(out.read_text())
    assert [r["policy"] for r in saved] == [r["policy"] for r in rows]
    by = {r["policy"]: r for r in rows}
    assert "fixed CP=1 DP=4" not in by  # a 30000-token document does not fit 16384 tokens on one rank
    assert by["ours"]["step_s"] <= min(r["step_s"] for r in rows) * (1 + F64_REL)
    assert all(r["imbalance"] >= 1 - F64_REL and r["memory_bytes"] > 0 and r["bytes_per_rank"] >= 0 for r in rows)


@pytest.mark.slow
def test_benchmark_dynamic_cp_runs_at_two_ranks():
    from megatron_ring_lab.bench.dynamic_cp import format_dynamic, run_dynamic_cp

    res = run_dynamic_cp(dict(world=2, mix="long-tail", num_docs=8, seed=0, scale=64, heads=2, kv_heads=1,
                              head_dim=16, layout="zigzag", iters=1, timeout=240, gpu_worlds=(8,)))
    names = [r["policy"] for r in res["rows"]]
    assert names == ["fixed CP=2", "Megatron balanced", "ours"]
    for r in res["rows"]:
        assert r["measured_s"] > 0 and r["pred_step_s"] > 0 and r["measured_imbalance"] >= 1 - F64_REL
    text = format_dynamic(res)
    assert "model only, unscaled lengths, 8 GPUs" in text and "ours" in text
