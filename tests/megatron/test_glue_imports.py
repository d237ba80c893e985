"""What importing the glue costs: ``megatron_ring.megatron`` imports its parts at first use (PEP 562), and
``compat.mcore_version()`` reads megatron-core's version from ``megatron/core/package_info.py`` without importing
``megatron.core`` (whose ``__init__`` imports most of megatron-core: about 8 s of CPU on 2 cores). So a process
that only asks for the version (the doctor's CLI) does not import Megatron, while every public name still
imports as before, and the fork launcher's preload (``forkrun.GLUE``) still imports the whole glue up front.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import megatron_ring.megatron as glue  # noqa: E402
from megatron_ring.megatron import compat  # noqa: E402
from megatron_ring_lab import forkrun  # noqa: E402
from tests.helpers.launch import ROOT  # noqa: E402


def test_every_public_name_imports_from_its_module():
    for name in glue.__all__:
        assert getattr(glue, name) is getattr(sys.modules[glue._EXPORTS[name]], name), name
    assert set(glue.__all__) == set(glue._EXPORTS) and set(glue.__all__) <= set(dir(glue))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        glue.not_a_name  # noqa: B018


def test_the_fork_launchers_preload_covers_the_glue():
    """A module the package's __init__ no longer imports is in forkrun.GLUE, so the ranks forked from a preloaded
    process find it imported."""
    assert set(glue.MODULES) <= set(forkrun.GLUE.split(",")), sorted(set(glue.MODULES) - set(forkrun.GLUE.split(",")))
    assert set(forkrun.GLUE.split(",")) <= set(forkrun.PRELOAD.split(","))


def test_the_version_read_from_the_file_is_megatron_cores(tmp_path, monkeypatch):
    from megatron.core import package_info

    assert compat._package_info_constants() == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    # the negative control: it is the file that answers (another megatron first on the path, another version)
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 7\nMINOR = 3\nPATCH = 1\nimport os\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat._package_info_constants() == (7, 3, 1)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 7\nMINOR = '3'\nPATCH = 1\n")
    assert compat._package_info_constants() is None  # not int literals: package_info itself answers


@pytest.mark.slow  # a fresh interpreter: what this process imported cannot be undone
def test_the_version_and_the_package_import_no_megatron():
    code = ("import sys\nimport megatron_ring.megatron as g\nfrom megatron_ring.megatron import compat\n"
            "v = compat.mcore_version()\nprint(v, 'megatron.core' in sys.modules)\n"
            "from megatron_ring.megatron import RingConfig\nprint(RingConfig.__module__, 'megatron.core' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = p.stdout.split("\n")[:2]
    assert first.endswith("False") and first.startswith(str(compat.mcore_version())), p.stdout
    assert second.startswith("megatron_ring.megatron.config "), p.stdout
