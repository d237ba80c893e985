"""The package's import rules (docs/design.md, "Package layout"), checked on the source text.

Two trees: the library ``megatron_ring/`` (what ``pip install megatron_ring`` ships) and the lab
``lab/megatron_ring_lab/`` (CPU harness, CP doctor, benchmark and planner CLIs, launcher; a second
distribution). Every ``import`` of a ``megatron_ring`` or ``megatron_ring_lab`` module, at module level or inside
a function, counts. The rules:
- no import circles between modules;
- each part of the library imports only the parts below it (``ALLOWED``): leaves (errors, breakdown, timing, settings,
  device, triton_launch) import nothing of the package; transport, wire, kernels and schedules only leaves and themselves; the
  core engine those; strategies the core; the public face (api, sequence, ``__init__``) the strategies;
- the Megatron glue imports only the package's public face (``import megatron_ring`` /
  ``from megatron_ring import ...``) and itself;
- the library never imports the lab (``megatron_ring_lab``), not even by a module name in a string, except the
  deprecated command spellings of ``megatron_ring/_moved.py``; only the glue imports Megatron;
- inside the lab, nothing imports the CP doctor but the doctor itself.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / "megatron_ring"
LAB_ROOT = REPO / "lab" / "megatron_ring_lab"
# the deprecated command spellings (python -m megatron_ring.doctor, ...): the only library modules that name the
# lab, as a string handed to runpy, never as an import
MOVED_SHIMS = {"megatron_ring._moved"}
# the modules at the old spellings, which only call megatron_ring._moved
SHIM_MODULES = MOVED_SHIMS | {"megatron_ring.benchmark", "megatron_ring.plan", "megatron_ring.doctor",
                              "megatron_ring.doctor.__main__", "megatron_ring.megatron.cpu",
                              "megatron_ring.megatron.cpu.__main__", "megatron_ring.megatron.training_cpu"}

LEAVES = {"errors", "breakdown", "timing", "device", "settings", "triton_launch"}
# part -> the parts it may import (besides itself and the leaves)
ALLOWED = {
    "transport": set(), "wire": set(), "kernels": set(), "schedules": set(),
    "core": {"transport", "wire", "kernels", "schedules"},
    "strategies": {"planning", "core", "transport", "wire", "kernels", "schedules"},
    "planning": {"core", "wire", "schedules"},
    "face": {"strategies", "planning", "core", "transport", "wire", "kernels", "schedules"},
    "megatron": {"__face__"},
    "moved": set(),
}
FACE_MODULES = {"__init__", "api", "call", "sequence"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to((LAB_ROOT if path.is_relative_to(LAB_ROOT) else ROOT).parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if parts == ["megatron_ring_lab"]:
        return "lab"
    if len(parts) == 1:
        return "face"  # megatron_ring itself (its __init__)
    if parts[0] == "megatron_ring_lab":
        return "doctor" if parts[1] == "doctor" else "lab"
    if module in SHIM_MODULES:
        return "moved"
    head = parts[1]
    if head in LEAVES:
        return "leaf"
    if head in FACE_MODULES:
        return "face"
    return head


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, is_face_import) for every megatron_ring / megatron import in the file."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    me = _module_name(path).split(".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, a.name == "megatron_ring") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me if is_pkg else me[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("megatron_ring"):
                out.append((mod, node.lineno, False))
                continue
            # from megatron_ring.x import y: y is a name of module x, or the submodule x.y
            for a in node.names:
                base_dir = LAB_ROOT.parent if mod.startswith("megatron_ring_lab") else ROOT.parent
                sub = base_dir.joinpath(*mod.split("."), a.name)
                if sub.is_dir() or sub.with_suffix(".py").exists():
                    out.append((f"{mod}.{a.name}", node.lineno, False))
                else:
                    out.append((mod, node.lineno, mod == "megatron_ring"))
    return out


def _sources(*roots: pathlib.Path):
    return sorted(p for r in (roots or (ROOT,)) for p in r.rglob("*.py") if "__pycache__" not in p.parts)


def _all_sources():
    return _sources(ROOT, LAB_ROOT)


def _edges():
    edges = {}
    for path in _all_sources():
        me = _module_name(path)
        for mod, line, face in _imports(path):
            if mod.startswith("megatron_ring") and mod != me:
                edges.setdefault(me, []).append((mod, line, face, path))
    return edges


def test_no_import_circles():
    modules = {_module_name(p) for p in _all_sources()}
    graph = {m: set() for m in modules}
    for me, targets in _edges().items():
        for mod, *_ in targets:
            # "from megatron_ring.x import y" may name module x.y; the module itself otherwise
            target = mod if mod in modules else mod.rsplit(".", 1)[0]
            if target in modules and target != me:
                graph[me].add(target)
    # the package face (megatron_ring/__init__) imports the library; the glue imports the face: an edge
    # to "megatron_ring" from inside the library itself would be a circle, which this search finds too.
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_part_imports_only_the_parts_below_it():
    bad = []
    for me, targets in _edges().items():
        mine = _part(me)
        for mod, line, face, path in targets:
            theirs = _part(mod)
            if (theirs == "leaf" and mine != "megatron") or theirs == "moved":
                continue
            if mine in ("lab", "doctor"):
                if theirs == "doctor" and mine != "doctor":
                    bad.append(f"{path}:{line}: the lab's {me} imports the doctor ({mod}); nothing may")
                continue  # the lab may use any part of the library
            if theirs in ("lab", "doctor"):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: the library imports the lab ({mod})")
            elif mine == "leaf":
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: a leaf module imports {mod}")
            elif mine == "megatron":
                if not (face or theirs == "megatron"):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line}: the Megatron glue imports {mod}; "
                               "use the package face (from megatron_ring import ...)")
            elif theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mine} imports {theirs} ({mod})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("forbidden", ["megatron_ring_lab", "megatron"])
def test_the_library_imports_no_lab_and_no_megatron(forbidden):
    bad = []
    for path in _sources(ROOT):
        if forbidden == "megatron" and _part(_module_name(path)) == "megatron":
            continue
        for mod, line, _ in _imports(path):
            if mod == forbidden or mod.startswith(forbidden + "."):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {mod}")
    assert not bad, "\n".join(bad)


def _lab_module_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """String constants that name a lab module (what runpy / importlib would load)."""
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and (n.value == "megatron_ring_lab" or n.value.startswith("megatron_ring_lab."))]


def test_the_library_names_no_lab_module_but_the_moved_commands():
    bad = [f"{p.relative_to(ROOT.parent)}:{line}: {value!r}" for p in _sources(ROOT)
           if _module_name(p) not in MOVED_SHIMS for line, value in _lab_module_strings(p)]
    assert not bad, "the library loads a lab module by name:\n" + "\n".join(bad)
    shims = [p for p in _sources(ROOT) if _module_name(p) in MOVED_SHIMS]
    assert shims and all(_lab_module_strings(p) for p in shims), "the check finds the shims' lab names"


def test_the_lab_is_not_shipped_with_the_library():
    """setup.cfg's package list is the library alone; the lab is its own distribution (lab/pyproject.toml)."""
    cfg = (REPO / "setup.cfg").read_text()
    include = cfg.split("[options.packages.find]", 1)[1].split("[", 1)[0]
    assert "megatron_ring_lab" not in include and "megatron_ring*" not in include, include
    assert not (ROOT / "tools").exists() and not (ROOT / "doctor" / "cli.py").exists()
    assert 'name = "megatron-ring-lab"' in (REPO / "lab" / "pyproject.toml").read_text()


def test_the_rules_see_the_package():
    """The checks above are not vacuous: they find the engine's imports and classify every file."""
    edges = _edges()
    assert ("megatron_ring.schedules.layouts" in {m for m, *_ in edges["megatron_ring.core.plan"]})
    parts = {_part(_module_name(p)) for p in _all_sources()}
    assert parts <= set(ALLOWED) | {"leaf", "lab", "doctor"}, parts
    assert {"lab", "doctor"} <= parts, "the lab's files are read too"


# The glue's own layout (docs/design.md, "The Megatron glue"): subpackage -> the glue parts it may import.
# "base" is compat, config, arguments, env and contract; the glue's __init__ (its face) may import everything.
GLUE_ALLOWED = {
    "base": {"base"},
    "groups": {"base"},
    "data": {"base", "groups"},
    "attention": {"base", "groups", "data"},
    "spec": {"base", "groups", "data", "attention"},
    # the deprecated spellings python -m megatron_ring.megatron.cpu / .training_cpu (megatron_ring/_moved.py)
    "cpu": set(), "training_cpu": set(),
}
GLUE_BASE = {"compat", "config", "arguments", "env", "contract"}


def _glue_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["megatron_ring", "megatron"]:
        return None
    if len(parts) == 2:
        return "face"
    return "base" if parts[2] in GLUE_BASE else parts[2]


def test_the_glue_is_split_by_entry_path():
    bad = []
    glue = {_module_name(p) for p in _sources() if _glue_part(_module_name(p))}
    for me, targets in _edges().items():
        mine = _glue_part(me)
        if mine in (None, "face"):
            continue
        assert mine in GLUE_ALLOWED, f"{me}: a glue module outside the known subpackages ({sorted(GLUE_ALLOWED)})"
        for mod, line, face, path in targets:
            theirs = _glue_part(mod if mod in glue else mod.rsplit(".", 1)[0])
            if theirs is None or theirs == mine:
                continue
            if theirs not in GLUE_ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: glue {mine} imports glue {theirs} ({mod})")
    assert not bad, "\n".join(bad)


def test_only_compat_knows_megatron_versions():
    """Version detection (megatron-core's version, or which Megatron-LM files exist) lives in compat.py only; the
    contract table (contract.py) names the releases an entry exists on, and megatron-core's package_info."""
    markers = ("package_info", "mcore_version", "importlib.metadata", "find_spec(\"megatron", "__version__")
    bad = []
    for path in _sources():
        if _glue_part(_module_name(path)) is None or path.name in ("compat.py", "contract.py"):
            continue
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT.parent)}: {m}" for m in markers if m in text]
    assert not bad, "version knowledge outside megatron_ring/megatron/compat.py and contract.py:\n" + "\n".join(bad)
