"""Fixtures for the multi-node tests: two network namespaces ("hosts") for the whole session, cached
single-node baselines, and a fault/parity table printed at the end of the run (and written as JSON to
``$MN_REPORT`` if set)."""
from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

import cluster  # noqa: E402
import netns  # noqa: E402
from mn_report import REPORT  # noqa: E402

_BASELINES: dict = {}


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    """Two namespaces joined by a veth pair (10.77.0.1/24, 10.77.0.2/24), each with its fork server (cluster.py);
    removed at session end."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    with netns.TwoHosts() as hs:
        servers = cluster.start_fork_servers(hs, str(tmp_path_factory.mktemp("fork-servers")))
        try:
            yield hs
        finally:
            cluster.stop_fork_servers(servers)


@pytest.fixture
def job_dir(tmp_path):
    return str(tmp_path)


@pytest.fixture(scope="session")
def baseline(hosts, tmp_path_factory):
    """``baseline(tp, cp, steps)``: losses of the same training on ONE host (``nproc = tp * cp``); cached."""
    def get(tp: int, cp: int, steps: int) -> list[float]:
        key = (tp, cp, steps)
        if key not in _BASELINES:
            out = str(tmp_path_factory.mktemp(f"single_tp{tp}_cp{cp}"))
            job = cluster.run_job(hosts[:1], out, cluster.train_args(tp=tp, cp=cp, steps=steps, out=out),
                                  nproc=tp * cp, env=cluster.QUIET_ENV, timeout=cluster.JOB_TIMEOUT)
            assert [n["rc"] for n in job.nodes] == [0], job.log()
            _BASELINES[key] = job.losses
        return _BASELINES[key]
    return get


def pytest_terminal_summary(terminalreporter):
    if not (REPORT["faults"] or REPORT["parity"]):
        return
    tr = terminalreporter
    tr.section("megatron_ring multi-node: faults and parity")
    for row in REPORT["faults"]:
        tr.write_line(f"fault {row['case']}: killed {row['killed']}; exits after fault: "
                      + ", ".join(f"{k} {v}" for k, v in row["exits"].items()))
        for r, msg in row["messages"].items():
            tr.write_line(f"    rank {r}: {msg[:160]}")
    for row in REPORT["parity"]:
        tr.write_line(f"parity {row['case']}: single-node {row['single']} | 2-node {row['multi']} | "
                      f"max |diff| {row['max_abs_diff']:.3g}")
    path = os.environ.get("MN_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)
