"""examples/train_gpt.py on 2 hosts x 2 processes gives the single-host losses (same seed).

Each host is a network namespace with its own address; each runs its own
``torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr 10.77.0.1``; gloo talks over the veth
pair. Tolerances: the 2-host run performs the same floating-point operations in the same order as the
1-host run with the same (TP, CP), so losses must agree to ``EXACT`` (measured: bit-identical); against
Megatron's own attention at TP = CP = 1 they must agree to ``REL_VS_CP1`` (measured: ~1e-7 relative).
"""
import math

import pytest

import cluster
from mn_report import REPORT
from placement import inter_node_hops, min_inter_node_hops

STEPS = 3
EXACT = 1e-6
REL_VS_CP1 = 1e-4

pytestmark = pytest.mark.slow


def _run_two_hosts(hosts, out, tp, cp, extra=()):
    job = cluster.run_job(hosts, out, cluster.train_args(tp=tp, cp=cp, steps=STEPS, out=out, extra=list(extra)),
                          nproc=2, env=cluster.QUIET_ENV, timeout=cluster.JOB_TIMEOUT)
    assert [n["rc"] for n in job.nodes] == [0, 0], job.log()
    assert len(job.losses) == STEPS and all(math.isfinite(x) for x in job.losses), job.log()
    # really two hosts: ranks 0,1 share one network namespace, ranks 2,3 the other
    ns = {r: rec["netns"] for r, rec in job.ranks.items()}
    assert ns[0] == ns[1] != ns[2] == ns[3], ns
    assert {r: rec["node_rank"] for r, rec in job.ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    # where the hosts have fork servers (conftest.py), every worker came from them: none was refused
    assert job.forked == (4 if cluster.FORK_SERVERS else 0), job.forked
    return job


def _compare(case, single, multi, reference):
    diff = max(abs(a - b) for a, b in zip(single, multi))
    REPORT["parity"].append(dict(case=case, single=[round(x, 6) for x in single],
                                 multi=[round(x, 6) for x in multi], max_abs_diff=diff,
                                 cp1_reference=[round(x, 6) for x in reference]))
    assert len(single) == len(multi) == STEPS
    assert diff <= EXACT, f"2-host losses {multi} differ from 1-host {single} by {diff}"
    for a, b in zip(multi, reference):
        assert abs(a - b) <= REL_VS_CP1 * abs(b), f"2-host losses {multi} vs Megatron CP=1 {reference}"
    assert multi[-1] < multi[0]  # it trains


def _check_ring_placement(job, cp):
    node_of = {r: rec["netns"] for r, rec in job.ranks.items()}
    rings = {tuple(rec["ring"]) for rec in job.ranks.values()}
    assert all(len(ring) == cp for ring in rings)
    for ring in rings:
        hops = inter_node_hops(ring, node_of)
        assert hops == min_inter_node_hops(ring, node_of), f"ring {ring} crosses nodes {hops} times per step"
    for r, rec in job.ranks.items():  # neighbours recorded by the provider agree with the ring order
        ring, i = rec["ring"], rec["ring_index"]
        assert ring[i] == r and rec["next_rank"] == ring[(i + 1) % cp] and rec["prev_rank"] == ring[i - 1]
    return rings


def test_cp4_ring_across_two_hosts_matches_single_host(hosts, baseline, job_dir):
    job = _run_two_hosts(hosts, job_dir, tp=1, cp=4)
    rings = _check_ring_placement(job, 4)
    assert rings == {(0, 1, 2, 3)}  # 2 of the 4 hops per ring step cross hosts (1->2, 3->0): the minimum
    _compare("tp1_cp4", baseline(1, 4, STEPS), job.losses, baseline(1, 1, STEPS))


def test_tp2_cp2_across_two_hosts_matches_single_host(hosts, baseline, job_dir):
    job = _run_two_hosts(hosts, job_dir, tp=2, cp=2)
    rings = _check_ring_placement(job, 2)
    # Megatron's order tp-cp-...: TP pairs (0,1), (2,3) stay on a host, the CP rings span both hosts
    assert rings == {(0, 2), (1, 3)}
    _compare("tp2_cp2", baseline(2, 2, STEPS), job.losses, baseline(1, 1, STEPS))


def test_hierarchical_sub_rings_map_to_hosts_and_stay_exact(hosts, baseline, job_dir):
    job = _run_two_hosts(hosts, job_dir, tp=1, cp=4, extra=["--hierarchical-context-parallel-sizes", "2", "2"])
    node_of = {r: rec["netns"] for r, rec in job.ranks.items()}
    for r, rec in job.ranks.items():
        inner, outer = rec["hierarchical"]
        assert r in inner and r in outer and len(inner) == len(outer) == 2
        assert len({node_of[x] for x in inner}) == 1, f"rank {r}: level-0 sub-ring {inner} leaves its host"
        assert len({node_of[x] for x in outer}) == 2, f"rank {r}: level-1 sub-ring {outer} stays on one host"
    expect = {0: [[0, 1], [0, 2]], 1: [[0, 1], [1, 3]], 2: [[2, 3], [0, 2]], 3: [[2, 3], [1, 3]]}
    assert {r: rec["hierarchical"] for r, rec in job.ranks.items()} == expect
    _check_ring_placement(job, 4)
    _compare("tp1_cp4_hierarchical_2x2", baseline(1, 4, STEPS), job.losses, baseline(1, 1, STEPS))
