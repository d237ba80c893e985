"""scripts/gpu_check.sh: its table step (tests/gpu/check_table.py) on fabricated output folders, in-process
(fast tier): one table, exit 0 only when every step that ran passed; and the script itself here (no GPU):
says so and exits 0 (slow: it starts a process)."""
import json
import pathlib
import subprocess

import pytest

from tests.gpu import check_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = [{"P": 2, "efficiency": 0.9, "ring_ms": 1.5}, {"P": 4, "efficiency": 0.8, "ring_ms": 2.5}]


LAYER = "# layer host time: ...\nlayer fwd+bwd 1.465 ms | ring_attention alone 1.398 ms | glue 0.067 ms | outputs sha256 3d\n"


PLAN = ("# plan time of a new document layout: ...\n| P | tokens per rank | layout | mix | docs "
        "| masked tasks, most of a rank (planned) "
        "| plan ms (slowest rank) |\n|---|---|---|---|---|---|---|\n| 8 | 8192 | striped | web | 25 | 8 (8) | 25.7 |\n")


def _fabricate(tmp_path, pytest_rc=0, bench_rc=0, nccl=None, bench=BENCH, layer=(0, LAYER), plan=(0, PLAN)):
    (tmp_path / "pytest.txt").write_text("...\n" + ("FAILED tests/gpu/test_x.py::t - boom\n" if pytest_rc else "")
                                         + ("1 failed, 9 passed" if pytest_rc else "10 passed") + " in 3.0s\n")
    (tmp_path / "pytest.rc").write_text(f"{pytest_rc}\n")
    (tmp_path / "bench.json").write_text("log line\n" + json.dumps(bench))
    (tmp_path / "bench.err").write_text("")
    (tmp_path / "bench.rc").write_text(f"{bench_rc}\n")
    if layer is not None:
        (tmp_path / "layer.txt").write_text(layer[1])
        (tmp_path / "layer.rc").write_text(f"{layer[0]}\n")
    if plan is not None:
        (tmp_path / "plan.txt").write_text(plan[1])
        (tmp_path / "plan.rc").write_text(f"{plan[0]}\n")
    if nccl is not None:
        (tmp_path / "nccl.txt").write_text("\n".join(json.dumps(r) for r in nccl[1]) + "\n")
        (tmp_path / "nccl.rc").write_text(f"{nccl[0]}\n")
    return str(tmp_path)


def test_all_green_is_one_table_and_exit_0(tmp_path, capsys):
    assert check_table.main([_fabricate(tmp_path), "1"]) == 0
    text = capsys.readouterr().out
    assert text.count("check ") == 1 and "bench P=4" in text and "10 passed" in text and "glue 0.067 ms" in text
    assert any(ln.startswith("plan a new document layout") and ln.endswith("8, 8192, striped, web, 25, 8 (8), 25.7")
               and " ok " in ln for ln in text.splitlines()), text
    assert "ring over NCCL" in text and "skipped" in text


@pytest.mark.parametrize("broken", [dict(pytest_rc=1), dict(pytest_rc=124), dict(bench_rc=124), dict(bench=[]),
                                    dict(bench_rc=2), dict(nccl=(0, [])), dict(layer=(124, "")),
                                    dict(layer=(0, "Traceback ...\n")), dict(plan=(124, "")),
                                    dict(plan=(0, "Traceback ...\n")),
                                    dict(nccl=(0, [{"case": "p2p", "max_err": 1.0, "ms": 2, "ok": False}]))])
def test_any_failed_or_timed_out_step_exits_1(tmp_path, capsys, broken):
    assert check_table.main([_fabricate(tmp_path, **broken), "2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_negative_control_a_good_nccl_row_is_ok(tmp_path):
    good = (0, [{"case": "p2p bf16", "max_err": 1e-3, "ms": 2.0, "ok": True}])
    assert all(r[2] == "ok" for r in check_table.rows(_fabricate(tmp_path, nccl=good)) if r[2] != "skipped")


@pytest.mark.slow
def test_script_without_a_gpu_says_so_and_exits_0():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_check.sh")]).returncode == 0
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "no usable CUDA GPU" in run.stdout, run.stdout + run.stderr
