"""The package's import rules (docs/design.md, "Package layout"), checked on the source text.

Every ``import`` of a ``megatron_ring`` module, at module level or inside a function, counts. The rules:
- no import circles between modules;
- each part imports only the parts below it (``ALLOWED``): leaves (errors, breakdown, timing) import nothing of
  the package; transport, wire, kernels and schedules only leaves and themselves; the core engine those;
  strategies the core; the public face (api, sequence, ``__init__``) the strategies;
- the Megatron glue imports only the package's public face (``import megatron_ring`` /
  ``from megatron_ring import ...``) and itself;
- no part of the library imports a tool (``megatron_ring.tools``), and only the glue imports Megatron;
- the CP doctor (``megatron_ring.doctor``, a tool that runs Megatron-LM's loop) may import the face, the tools,
  the glue and Megatron; nothing imports it.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megatron_ring"

LEAVES = {"errors", "breakdown", "timing", "device"}
# part -> the parts it may import (besides itself and the leaves)
ALLOWED = {
    "transport": set(), "wire": set(), "kernels": set(), "schedules": set(),
    "core": {"transport", "wire", "kernels", "schedules"},
    "strategies": {"core", "transport", "wire", "kernels", "schedules"},
    "face": {"strategies", "core", "transport", "wire", "kernels", "schedules"},
    "megatron": {"__face__"},
    "tools": {"face", "strategies", "core", "transport", "wire", "kernels", "schedules"},
    "cli": {"tools"},
    "doctor": {"face", "tools", "megatron"},
}
FACE_MODULES = {"__init__", "api", "sequence"}
CLI_MODULES = {"benchmark", "plan"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"  # megatron_ring itself (its __init__)
    head = parts[1]
    if head in LEAVES:
        return "leaf"
    if head in FACE_MODULES:
        return "face"
    if head in CLI_MODULES:
        return "cli"
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
                sub = ROOT.parent.joinpath(*mod.split("."), a.name)
                if sub.is_dir() or sub.with_suffix(".py").exists():
                    out.append((f"{mod}.{a.name}", node.lineno, False))
                else:
                    out.append((mod, node.lineno, mod == "megatron_ring"))
    return out


def _sources():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _edges():
    edges = {}
    for path in _sources():
        me = _module_name(path)
        for mod, line, face in _imports(path):
            if mod.startswith("megatron_ring") and mod != me:
                edges.setdefault(me, []).append((mod, line, face, path))
    return edges


def test_no_import_circles():
    modules = {_module_name(p) for p in _sources()}
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
            if theirs == "leaf" and mine != "megatron":
                continue
            if mine == "leaf":
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: a leaf module imports {mod}")
            elif theirs == "doctor" and mine != "doctor":
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mine} imports the doctor ({mod}); nothing may")
            elif mine == "megatron":
                if not (face or theirs == "megatron"):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line}: the Megatron glue imports {mod}; "
                               "use the package face (from megatron_ring import ...)")
            elif theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mine} imports {theirs} ({mod})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("forbidden", ["megatron_ring.tools", "megatron"])
def test_the_library_imports_no_tool_and_no_megatron(forbidden):
    bad = []
    for path in _sources():
        part = _part(_module_name(path))
        if part in ("tools", "cli", "doctor") or (forbidden == "megatron" and part == "megatron"):
            continue
        for mod, line, _ in _imports(path):
            if mod == forbidden or mod.startswith(forbidden + "."):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_rules_see_the_package():
    """The checks above are not vacuous: they find the engine's imports and classify every file."""
    edges = _edges()
    assert ("megatron_ring.schedules.layouts" in {m for m, *_ in edges["megatron_ring.core.engine"]})
    parts = {_part(_module_name(p)) for p in _sources()}
    assert parts <= set(ALLOWED) | {"leaf"}, parts


# The glue's own layout (docs/design.md, "The Megatron glue"): subpackage -> the glue parts it may import.
# "base" is compat, config, arguments and env; the glue's __init__ (its face) may import everything.
GLUE_ALLOWED = {
    "base": {"base"},
    "groups": {"base"},
    "data": {"base", "groups"},
    "attention": {"base", "groups", "data"},
    "spec": {"base", "groups", "data", "attention"},
    "cpu": {"base", "data"},  # the harness installs data/token_order's pure-torch THD partitioner
}
GLUE_BASE = {"compat", "config", "arguments", "env"}


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
    """Version detection (megatron-core's version, or which Megatron-LM files exist) lives in compat.py only."""
    markers = ("package_info", "mcore_version", "importlib.metadata", "find_spec(\"megatron", "__version__")
    bad = []
    for path in _sources():
        if _glue_part(_module_name(path)) is None or path.name == "compat.py":
            continue
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT.parent)}: {m}" for m in markers if m in text]
    assert not bad, "version knowledge outside megatron_ring/megatron/compat.py:\n" + "\n".join(bad)
