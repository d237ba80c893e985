"""scripts/bench_revisions.py with ``--trees``: ``--gpu-rows`` (one worker per tree, rounds interleaved, a row per
size) and ``--plan-time`` (this checkout's planning row against each tree). Run here on CPU (``--gpu-device cpu``:
the script's plumbing, not a GPU figure), both trees this checkout."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # two worker processes
def test_gpu_rows_of_two_trees_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("bench_revisions", os.path.join(ROOT, "scripts", "bench_revisions.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["A", "B", "--trees", ROOT, ROOT, "--gpu-rows", "--gpu-device", "cpu", "--gpu-sizes", "2:32",
                     "--rounds", "1", "--iters", "1"])
    assert len(rows) == 1 and rows[0]["P"] == 2 and rows[0]["tokens_per_rank"] == 32
    assert len(rows[0]["a"]) == len(rows[0]["b"]) == 1 and rows[0]["ratio"] > 0
    out = capsys.readouterr().out
    assert "| 2 | 32 |" in out
    # the host-time breakdown (every device) beside the kernel one (CUDA only: no such table here)
    assert "host ms of the slowest rank's call by kind (forward / backward / attention_ops" in out
    assert "kernel GPU ms" not in out


@pytest.mark.slow  # two worker processes
def test_plan_time_of_two_trees(capsys):
    spec = importlib.util.spec_from_file_location("bench_revisions", os.path.join(ROOT, "scripts", "bench_revisions.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from megatron_ring_lab.bench.plan_time import GRID

    rows = mod.main(["A", "B", "--trees", ROOT, ROOT, "--plan-time", "--rounds", "1", "--iters", "1"])
    assert len(rows) == len(GRID) and all(r["a_ms"] > 0 and r["b_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["planned"][0] == r["planned"][1] == r["planned"][2] for r in rows)
    out = capsys.readouterr().out
    assert "P=8  8192 per rank  striped   web" in out and "P=8  8192 per rank doc-zigzag   web" in out
