"""Module docstrings and comments say true things about the code they name.

In every source file of the library (``megatron_ring``) and the lab (``lab/megatron_ring_lab``):

* every Sphinx cross-reference (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:data:``, ``:attr:``,
  ``:exc:``) resolves: an absolute dotted name (``megatron_ring.core.merge.merge_into``), a relative one
  (``.rotation``, ``.masks.BlockMask``: from the file's module, then its packages upwards), or a bare name
  (``RingPlan``, ``forward``: in the file's module, one of its classes, or a builtin);
* every repository path it names (``megatron_ring/...``, ``tests/...``, ``scripts/...``, ``docs/...``) exists;
* every ``MEGATRON_RING_*`` variable it names is one ``megatron_ring/settings.py`` reads.

Nothing is imported that the file does not import itself (the modules are imported, not run).
"""
from __future__ import annotations

import builtins
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [(ROOT, "megatron_ring"), (ROOT / "lab", "megatron_ring_lab")]
ROLE_RE = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj):`~?([\w.]+)`")
PATH_RE = re.compile(r"(?<![\w./'\"-])((?:scripts|tests|docs|megatron_ring|lab)/[\w./-]*\w)(?::\d+)?")
VAR_RE = re.compile(r"\bMEGATRON_RING_[A-Z0-9_]*[A-Z0-9]\b")


def _files() -> list[tuple[Path, str]]:
    out = []
    for base, pkg in PACKAGES:
        for path in sorted((base / pkg).rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((path, ".".join(parts)))
    return out


def _resolve_dotted(name: str):
    """The object a fully dotted name stands for (ImportError/AttributeError if none)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


#: modules that import an optional dependency at their top (checked where it is installed)
NEEDS = {"megatron_ring.core._foreach_kernels": "triton", "megatron_ring.kernels._dropout_kernels": "triton",
         "megatron_ring.wire._fp8_kernels": "triton"}


def _resolves(ref: str, module: str, is_package: bool) -> bool:
    mod = importlib.import_module(module)
    candidates = []
    if ref.startswith("."):
        rel = ref.lstrip(".")
        base = module if is_package else module.rsplit(".", 1)[0]
        scopes = [module, base]
        while "." in base:
            base = base.rsplit(".", 1)[0]
            scopes.append(base)
        candidates = [f"{s}.{rel}" for s in scopes]
    elif ref.split(".")[0] in ("megatron_ring", "megatron_ring_lab", "torch", "megatron"):
        candidates = [ref]
    else:
        head = ref.split(".")[0]
        if hasattr(builtins, head):
            return True
        candidates = [f"{module}.{ref}"]
        for value in list(vars(mod).values()):  # a method or attribute of one of the module's classes
            if isinstance(value, type) and getattr(value, "__module__", None) == module and hasattr(value, head):
                return True
        pkg = module if is_package else module.rsplit(".", 1)[0]
        candidates.append(f"{pkg}.{ref}")
    for c in candidates:
        try:
            _resolve_dotted(c)
            return True
        except (ImportError, AttributeError):
            continue
    return False


def _settings_variables() -> set[str]:
    text = (ROOT / "megatron_ring" / "settings.py").read_text()
    return set(VAR_RE.findall(text))


@pytest.mark.parametrize("path,module", [pytest.param(p, m, id=m) for p, m in _files()])
def test_references_in_source_resolve(path: Path, module: str):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    text = path.read_text()
    is_package = path.name == "__init__.py"
    bad = [f":{ref}" for ref in sorted(set(ROLE_RE.findall(text))) if not _resolves(ref, module, is_package)]
    for rel in sorted(set(PATH_RE.findall(text))):
        clean = rel.rstrip(".")
        if "*" in clean or "{" in clean:
            continue
        if not (ROOT / clean).exists() and not (ROOT / "lab" / clean).exists():
            bad.append(f"path {clean}")
    known = _settings_variables()
    bad += [f"variable {v}" for v in sorted(set(VAR_RE.findall(text)) - known)
            if not any(v.startswith(k.rstrip("_") + "_") or v == k for k in known if k.endswith("_"))]
    assert not bad, f"{path.relative_to(ROOT)} names what does not exist: {bad}"


def test_the_check_catches_a_wrong_reference():
    """Negative control: a reference to a name that is not there fails, one that is there passes."""
    assert _resolves(".rotation", "megatron_ring.core.engine", False)
    assert _resolves("megatron_ring.core.merge.merge_into", "megatron_ring.core.engine", False)
    assert not _resolves(".rotations", "megatron_ring.core.engine", False)
    assert not _resolves("megatron_ring.core.merge.merge_onto", "megatron_ring.core.engine", False)
    assert not _resolves("NoSuchPlan", "megatron_ring.core.engine", False)
    assert "MEGATRON_RING_COMM_TYPE" not in _settings_variables()
