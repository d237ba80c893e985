"""Each ``MEGATRON_RING_*`` variable is read in exactly one place, megatron_ring/settings.py, and a bad value
is refused there by name (docs/configuration.md, "Environment variables")."""
from __future__ import annotations

import pathlib
import re

import pytest

from megatron_ring import settings

REPO = pathlib.Path(__file__).resolve().parents[1]
READ = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[|environ\.get)\s*\(?\s*(f?[\"'])")


ALIAS = re.compile(r"(\w+)\s*=\s*os\.(?:environ\.get|getenv)\b")


def _readers(text: str) -> list[str]:
    """The lines of ``text`` that read an environment variable whose name is written there (directly, or
    through a local name for ``os.environ.get``: ``env = os.environ.get; env("MEGATRON_RING_X")``)."""
    aliases = [re.compile(rf"\b{re.escape(a)}\s*\(\s*f?[\"']MEGATRON_RING_") for a in ALIAS.findall(text)]
    return [line for line in text.splitlines()
            if (READ.search(line) and "MEGATRON_RING_" in line) or any(a.search(line) for a in aliases)]


def test_every_ring_variable_is_read_in_settings_only():
    bad = []
    for root in ("megatron_ring", "lab"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "megatron_ring" / "settings.py":
                continue
            bad += [f"{path.relative_to(REPO)}: {line.strip()}" for line in _readers(path.read_text())]
    assert not bad, "MEGATRON_RING_* read outside megatron_ring/settings.py:\n" + "\n".join(bad)


def test_the_check_sees_a_read():
    """Negative control: a read written the way the code used to write it is found."""
    assert _readers('    raw = os.environ.get("MEGATRON_RING_TIMEOUT_S")\n')
    assert _readers('    raw = os.environ.get(f"MEGATRON_RING_AUTO_{name}")\n')
    assert _readers('        env = os.environ.get\n        n = int(env("MEGATRON_RING_DYNAMIC_DOCS", "64"))\n')
    assert not _readers('    raw = os.environ.get("RANK")\n')


def test_settings_read_every_documented_variable():
    text = (REPO / "megatron_ring" / "settings.py").read_text()
    for variable in ("MEGATRON_RING_TIMEOUT_S", "MEGATRON_RING_KV_PIECES", "MEGATRON_RING_COMM_DTYPE",
                     "MEGATRON_RING_CP_COMM_TYPE", "MEGATRON_RING_LAYOUT", "MEGATRON_RING_MTP_CP_INVARIANT",
                     "MEGATRON_RING_GPUS_PER_NODE", "MEGATRON_RING_OVERLAP", "MEGATRON_RING_AUTO_MEASURE",
                     "MEGATRON_RING_START_METHOD", "MEGATRON_RING_PRELOAD",
                     *settings.MACHINE_VARIABLES.values(), *settings.AUTO_VARIABLES.values()):
        assert f'"{variable}"' in text, variable


@pytest.mark.parametrize("variable,value,read", [
    ("MEGATRON_RING_TIMEOUT_S", "soon", settings.timeout_s),
    ("MEGATRON_RING_KV_PIECES", "0", settings.kv_pieces),
    ("MEGATRON_RING_KV_PIECES", "two", settings.kv_pieces),
    ("MEGATRON_RING_MTP_CP_INVARIANT", "maybe", settings.mtp_cp_invariant),
    ("MEGATRON_RING_GPUS_PER_NODE", "-8", settings.gpus_per_node),
    ("MEGATRON_RING_START_METHOD", "fork", settings.start_method),
    ("MEGATRON_RING_FLOPS", "fast", settings.machine_numbers),
])
def test_a_bad_value_is_refused_by_name(monkeypatch, variable, value, read):
    monkeypatch.setenv(variable, value)
    with pytest.raises(settings.SettingError, match=variable) as e:
        read()
    assert e.value.variable == variable and isinstance(e.value, ValueError)


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("MEGATRON_RING_KV_PIECES", raising=False)
    assert settings.kv_pieces() is None
    monkeypatch.setenv("MEGATRON_RING_KV_PIECES", " 3 ")
    assert settings.kv_pieces() == 3
    monkeypatch.setenv("MEGATRON_RING_CP_COMM_TYPE", "p2p, a2a")
    assert settings.cp_comm_type() == ("p2p", "a2a")
    monkeypatch.setenv("MEGATRON_RING_AUTO_BAND", "0.5")
    assert settings.auto_number("BAND", 0.3) == 0.5
    monkeypatch.setenv("MEGATRON_RING_AUTO_MEASURE", "0")
    assert settings.auto_measure() is False
