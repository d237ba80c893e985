"""The suite's own Megatron helpers change how fast a job starts, not what it computes.

tests/helpers/arg_docstrings.py caches megatron.training's per-class flag help (``_get_field_docstrings``) in the
fork servers: the parser built through the cache is the parser built without it, flag by flag (names, defaults,
help), and a caller that changes the mapping it got changes no later caller's.
"""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("megatron.training.argument_utils", reason="megatron.training (megatron-core >= 0.19 wheel)")

from megatron.training import argument_utils, arguments  # noqa: E402


def _flags() -> list[tuple]:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    return [(a.option_strings, a.dest, repr(a.default), a.help) for a in parser._actions]


def test_the_cached_flag_help_is_megatrons(monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.helpers import arg_docstrings  # installs itself at import where it was not yet

    factory = argument_utils.ArgumentGroupFactory
    original = getattr(factory._get_field_docstrings, "__wrapped__", factory._get_field_docstrings)
    monkeypatch.setattr(factory, "_get_field_docstrings", original)  # Megatron's own; restored afterwards
    plain = _flags()
    assert arg_docstrings.install() is True and factory._get_field_docstrings is not original
    assert _flags() == plain and any(h for *_, h in plain)  # some flag has help: the comparison is not vacuous
    assert arg_docstrings.install() is False  # installed once
    inst = object.__new__(factory)
    inst._get_field_docstrings(TransformerConfig).clear()
    assert inst._get_field_docstrings(TransformerConfig), "a caller's change reached the cache"
