"""Bad input across hosts: one rank with a different sequence length, dtype or configuration.

2 hosts x 1 process, CP = 2 (the ring crosses the veth link). Every rank must fail with the same
explanation, naming what differs and each rank's value, within ``BOUND_S`` of joining the process group,
and both torchruns must exit non-zero: never a hang, never a silently wrong loss.
"""
import json
import os

import pytest

import cluster
from mn_report import REPORT

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 10.0
BOUND_S = PG_TIMEOUT_S + float(os.environ.get("MN_EXIT_SLACK_S", "10"))


def _run(hosts, out, *, rank_args=None, fault="", timeout=cluster.JOB_TIMEOUT):
    env = dict(cluster.QUIET_ENV, MN_PG_TIMEOUT_S=str(PG_TIMEOUT_S), MEGATRON_RING_TIMEOUT_S="10", MN_FAULT=fault,
               MN_RANK_ARGS=json.dumps(rank_args or {}))
    return cluster.run_job(hosts, out, cluster.train_args(cp=2, steps=2, out=out), nproc=1, env=env,
                           timeout=timeout)


def _all_fail_alike(job, error_type, must_name, case=""):
    for i, node in enumerate(job.nodes):
        assert not node["timed_out"], f"node {i} hung\n{job.log()}"
        assert node["rc"] != 0, f"node {i} exited 0\n{job.log()}"
    msgs = []
    for r in (0, 1):
        rec = job.ranks[r]
        assert rec["status"] == "error" and rec["error_type"] == error_type, (r, rec, job.log())
        assert rec["t_exit"] - rec["t_init"] <= BOUND_S, f"rank {r} took {rec['t_exit'] - rec['t_init']:.1f}s"
        for word in must_name:
            assert word in rec["message"], (r, word, rec["message"])
        msgs.append(rec["message"])
    assert job.summary is None  # no training step was completed (no silent wrong loss)
    REPORT["faults"].append(dict(
        case=f"bad input: {case}", killed="nothing",
        exits={f"rank {r}": round(job.ranks[r]["t_exit"] - job.ranks[r]["t_init"], 2) for r in (0, 1)}
        | {"(measured from": "init_process_group, incl. imports and model build)"},
        messages={r: f"{job.ranks[r]['error_type']}: {job.ranks[r]['message']}" for r in (0, 1)}))
    return msgs


# --- data that differs at run time (same configuration everywhere): ring_attention's cross-rank check


def test_different_local_sequence_length_on_one_host(hosts, job_dir):
    job = _run(hosts, job_dir, fault="seq:rank=1")
    msgs = _all_fail_alike(job, "ValueError", ["different arguments", "q.shape[0]", "rank 0: q.shape[0]=64",
                                               "rank 1: q.shape[0]=32"], "rank 1 feeds half its local sequence")
    assert msgs[0] == msgs[1]  # shapes print as numbers: the very same text on both hosts


def test_different_dtype_on_one_host(hosts, job_dir):
    job = _run(hosts, job_dir, fault="dtype:rank=1")
    _all_fail_alike(job, "ValueError", ["different arguments", "q.dtype"], "rank 1 computes in bf16")
    assert "q.dtype=torch.bfloat16" in job.ranks[1]["message"] and "q.dtype=torch.float32" in job.ranks[0]["message"]


# --- configuration that differs between hosts: the provider's start-up check, naming the flag

CONFIG_CASES = {  # case -> (arguments of rank 1 only, flag the error must name)
    "context_parallel_size": (["--context-parallel-size", "1"], "--context-parallel-size"),
    "seq_length": (["--seq-length", "256"], "--seq-length"),
    "hierarchical_sizes": (["--hierarchical-context-parallel-sizes", "1", "2"],
                           "--hierarchical-context-parallel-sizes"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_different_configuration_on_one_host(hosts, job_dir, case):
    args, flag = CONFIG_CASES[case]
    job = _run(hosts, job_dir, rank_args={"1": args}, timeout=PG_TIMEOUT_S + 40)
    msgs = _all_fail_alike(job, "ContextParallelConfigError", [flag, "rank 0:", "rank 1:"], f"rank 1 launched with {' '.join(args)}")
    assert msgs[0] == msgs[1]
