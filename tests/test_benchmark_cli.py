"""The benchmark CLI's own logic on a tiny problem: modes interleaved, paired ratios, the ideal split,
the breakdown per piece count. Times mean nothing here (speed claims live in the CLI's output)."""
import pytest

from megatron_ring.tools.bench import main as benchmark

pytestmark = pytest.mark.slow

TINY = ["--seq", "64", "--heads", "4", "--head-dim", "8", "--iters", "2", "--no-limit", "--timeout", "120"]


def test_rows_have_paired_ratios_and_the_ideal_split():
    rows = benchmark.main(["--world-sizes", "2", "--kv-pieces", "auto", "2"] + TINY)
    assert [r["kv_pieces"] for r in rows] == ["auto", 2]
    for r in rows:
        assert r["split_fwd_bwd_s"] > 0 and r["split_efficiency"] > 0
        assert r["overlap_overhead_fwd_bwd"] > -1 and "ring_peak_mib_per_rank" in r
    # 2 pieces send one status element more per step than 1 (auto here: tiny, whole blocks)
    assert rows[1]["bytes_fwd_per_rank"] == rows[0]["bytes_fwd_per_rank"] + 4


def test_interleaved_rotates_the_order():
    seen = []
    modes = {m: ((lambda m=m: seen.append((m, 0))), (lambda m=m: seen.append((m, 1)))) for m in "abc"}
    times = benchmark._interleaved(modes, 2, lambda: None)
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1),
                    ("b", 0), ("c", 0), ("a", 0), ("b", 1), ("c", 1), ("a", 1)]
    assert all(len(t) == 2 for t in times.values())


def test_breakdown_one_table_per_piece_count():
    rows = benchmark.main(["--breakdown", "--world-sizes", "2", "--kv-pieces", "1", "2"] + TINY)
    assert [r["kv_pieces"] for r in rows] == [1, 2]
    for r in rows:
        assert any(k.endswith("|kernel") for k in r["mean"])
        # every exchange launch is timed (a real gloo ring: step 0 starts the first K/V hop)
        assert r["mean"].get("fwd|0|launch", 0.0) > 0, r["mean"]
        assert 0 <= r["other_s"] < r["total_s"]  # each rank's own untimed rest (timed regions never nest)
