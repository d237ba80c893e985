"""The command spellings that moved to the lab keep working for a release, with a deprecation message
(megatron_ring/_moved.py, CHANGELOG.md); run in-process (runpy), as ``python -m OLD --help`` would."""
from __future__ import annotations

import contextlib
import io
import runpy
import sys

import pytest

from megatron_ring._moved import MOVED, run_moved


def _run(module: str, argv: list[str]) -> tuple[str, str, object]:
    old, out, err = sys.argv, io.StringIO(), io.StringIO()
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = old
    return out.getvalue(), err.getvalue(), exit_.value.code


@pytest.mark.parametrize("old", ["megatron_ring.plan", "megatron_ring.benchmark", "megatron_ring.doctor",
                                 "megatron_ring.megatron.cpu", "megatron_ring.megatron.training_cpu"])
def test_old_spelling_runs_the_lab_command_with_a_warning(old):
    if old.startswith("megatron_ring.megatron"):
        pytest.importorskip("megatron.core")
    out, err, code = _run(old, ["--help"] if "cpu" not in old else [])
    new = MOVED[old]
    assert f"`python -m {old}` is deprecated" in err and f"use `python -m {new}`" in err
    assert f"python -m {new}" in out + err, "the lab's own usage line is printed"
    assert code in (0, 2, None) or isinstance(code, str)


def test_every_moved_name_is_a_lab_module():
    import importlib.util
    for old, new in MOVED.items():
        assert importlib.util.find_spec(old) is not None, old
        assert importlib.util.find_spec(new) is not None, new


def test_without_the_lab_the_old_spelling_says_how_to_get_it(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron_ring_lab" else real(name, *a))
    with pytest.raises(SystemExit, match=r"pip install \./lab"):
        with contextlib.redirect_stderr(io.StringIO()):
            run_moved("megatron_ring.plan.__main__")
