"""Test-only: megatron.training's flag help read from the config classes' source once per fork server, not once per
rank of every job.

megatron-core 0.19's ``megatron.training.arguments`` makes the flags of its config dataclasses from their source:
``ArgumentGroupFactory._get_field_docstrings`` reads each class's source file and parses it (``inspect.getsource``,
``ast.parse``) at every ``parse_args()``, so in every rank of every job. Measured in one rank of a two-iteration
CP = 2 job of the suite (cProfile, this 2-core machine): about 0.4 s of the rank's 1.4 s of CPU. The result is a
function of the class's source, which does not change during a test session; what the tests check does not
depend on where it is computed.

Imported by the fork servers the suite's jobs start from (tests/helpers/launch.py ``JOB_PRELOAD``, as ``ckpt_queue``),
this module wraps that method in a cache per class and fills it once by building Megatron's whole parser there (from a
copy of the environment: below), so every forked rank inherits it. Each call gets its own copy of the mapping. Without
megatron.training (the 0.16.1 wheel) this does nothing.
"""
from __future__ import annotations

import argparse
import functools
import os


def install() -> bool:
    """Wrap the method and fill its cache where this Megatron has it (True); else change nothing (False)."""
    try:
        from megatron.training import argument_utils, arguments
    except ImportError:
        return False
    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    original = getattr(factory, "_get_field_docstrings", None)
    if original is None or getattr(original, "_cached_per_class", False):
        return False
    cache: dict[type, dict[str, str]] = {}

    @functools.wraps(original)
    def cached(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in cache:
            cache[src_cfg_class] = original(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    cached._cached_per_class = True
    factory._get_field_docstrings = cached
    # The fill builds a throwaway parser: its defaults read the process's variables (``LOCAL_RANK``, ``WORLD_SIZE``,
    # ...), which here are the server's. Read from a copy of the environment, they leave nothing behind and the
    # server's record of what its imports read stays clean (else it refuses every job whose ranks get their variables
    # before they start: torchrun's workers, tests/megatron/test_crash_resume.py). Only the source cache stays.
    environ = os.environ
    os.environ = environ.copy()  # (a copy taken without reading each variable)
    try:
        arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    except Exception:  # noqa: BLE001 (the cache then fills in the first job's ranks, as without this module)
        pass
    finally:
        os.environ = environ
    return True


INSTALLED = install()
