"""The docs match the code: README.md and docs/*.md are read and every checkable claim is checked.

* the README's ``ring_attention(...)`` signature equals ``inspect.signature(ring_attention)`` (names, order,
  keyword-only, defaults), and every argument of its table is a parameter;
* every ``python -m MODULE`` names an importable module; for this project's CLIs ``--help`` runs (in this
  process) and lists every ``--flag`` the docs pass to it (subcommands included);
* every repository path the docs name (``scripts/...``, ``examples/...``, ``tests/...``, ``docs/...``,
  ``patches/...``, ``requirements/...``, ``megatron_ring/...``) exists;
* every dotted ``megatron_ring.x.y`` name resolves to a module or an attribute; ``--spec MODULE NAME``
  resolves too.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_RE = re.compile(r"(?<![\w./-])((?:scripts|examples|tests|docs|patches|requirements|megatron_ring)/[\w.*/-]*[\w/*])")
DOTTED_RE = re.compile(r"(?<![\w./-])(megatron_ring(?:\.[A-Za-z_]\w*)+)")
MODULE_RE = re.compile(r"python[\d.]* -m ([\w.]+)")
#: CLIs of this project whose --help is cheap (argparse, no work before parsing)
HELP_CLIS = ("megatron_ring_lab.plan", "megatron_ring_lab.benchmark")


def _text(path: Path) -> str:
    return path.read_text()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _readme_signature() -> str:
    text = _text(ROOT / "README.md")
    m = re.search(r"`(ring_attention\(q, k, v, \*,.*?\))`", text, re.S)
    assert m, "README.md has no `ring_attention(q, k, v, *, ...)` signature block"
    return " ".join(m.group(1).split())


def test_readme_ring_attention_signature_is_the_code_signature():
    from megatron_ring import ring_attention

    doc = ast.parse(f"def {_readme_signature()}: pass").body[0].args
    documented = [(a.arg, "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty) for a in doc.args]
    documented += [(a.arg, "KEYWORD_ONLY", ast.literal_eval(d)) for a, d in zip(doc.kwonlyargs, doc.kw_defaults)]
    actual = [(p.name, p.kind.name, p.default) for p in inspect.signature(ring_attention).parameters.values()]
    assert documented == actual, ("README.md's ring_attention signature differs from the code:\n"
                                  f"  README: {documented}\n  code:   {actual}")


def test_readme_argument_table_names_real_parameters():
    from megatron_ring import ring_attention

    params = set(inspect.signature(ring_attention).parameters)
    text = _text(ROOT / "README.md")
    table = text[text.index("| argument | meaning |"):]
    table = table[:table.index("\n\n")]
    named = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)(?:=[^`]*)?`", row.split("|")[1])}
    assert named, "no arguments found in README.md's table"
    assert named <= params, f"README.md's table documents non-parameters: {sorted(named - params)}"
    assert params <= named, f"parameters missing from README.md's table: {sorted(params - named)}"


def _commands():
    """(doc, module, subcommand or None, flags) for every ``python -m`` in the docs (code blocks with their
    backslash continuations; inline code up to its closing backtick)."""
    found = []
    for path in DOCS:
        text = _text(path).replace("\\\n", " ")
        for m in MODULE_RE.finditer(text):
            rest = text[m.end():]
            stop = min(i for i in (rest.find("\n"), rest.find("`"), len(rest)) if i >= 0)
            words = rest[:stop].split()
            sub = words[0] if words and re.fullmatch(r"[a-z][\w-]*", words[0]) else None
            flags = sorted({w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)})
            found.append((_rel(path), m.group(1), sub, flags))
    return found


def test_documented_modules_exist():
    # the project's own commands (find_spec("pip") would switch setuptools' distutils shim off for the process)
    missing = sorted({(doc, mod) for doc, mod, _, _ in _commands()
                      if mod.startswith("megatron_ring") and importlib.util.find_spec(mod) is None})
    assert not missing, f"`python -m` of modules that do not exist: {missing}"


@functools.lru_cache(maxsize=None)
def _help(module: str, sub: str | None) -> str:
    argv = [module] + ([sub] if sub else []) + ["--help"]
    old, out = sys.argv, io.StringIO()
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = old
    assert exit_.value.code in (0, None), f"{' '.join(argv)} exited with {exit_.value.code}"
    return out.getvalue()


@pytest.mark.parametrize("module", HELP_CLIS)
def test_documented_cli_flags_exist(module):
    cmds = [(doc, sub, flags) for doc, mod, sub, flags in _commands() if mod == module]
    assert cmds, f"the docs no longer mention `python -m {module}`"
    bad = []
    for doc, sub, flags in cmds:
        sub = sub if sub and sub in _help(module, None) else None  # a subcommand, not a positional value
        text = _help(module, sub)
        bad += [(doc, sub, f) for f in flags if not re.search(re.escape(f) + r"\b", text)]
    assert not bad, f"flags the docs pass to `python -m {module}` that its --help does not list: {sorted(set(bad))}"


def test_documented_paths_exist():
    missing = set()
    for path in DOCS:
        for m in PATH_RE.finditer(_text(path)):
            p = m.group(1).rstrip(".")
            if any(c in p for c in "*{}<>") or p.endswith("/..."):
                continue
            if not (ROOT / p).exists():
                missing.add((_rel(path), p))
    assert not missing, f"paths named in the docs that do not exist: {sorted(missing)}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_documented_dotted_names_resolve():
    pytest.importorskip("megatron.core", reason="the glue's names need megatron-core")
    names = {(_rel(p), m.group(1).rstrip(".")) for p in DOCS for m in DOTTED_RE.finditer(_text(p))}
    specs = {(_rel(p), f"{m.group(1)}.{m.group(2)}") for p in DOCS
             for m in re.finditer(r"--spec ([\w.]+) (\w+)", _text(p))}
    bad = sorted((doc, n) for doc, n in names | specs if not _resolves(n))
    assert len(names) > 20 and specs
    assert not bad, f"dotted names in the docs that are neither a module nor an attribute: {bad}"


def test_documented_environment_variables_are_read_somewhere():
    source = "\n".join(p.read_text() for d in ("megatron_ring", "lab", "scripts", "tests", "examples")
                       for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file())
    named = {(_rel(p), v) for p in DOCS for v in re.findall(r"MEGATRON_RING_[A-Z0-9_]*[A-Z0-9]", _text(p))}
    assert named
    bad = sorted((doc, v) for doc, v in named if v not in source)
    assert not bad, f"environment variables in the docs that no code reads: {bad}"


def test_documented_cp_flags_are_the_glue_arguments():
    pytest.importorskip("megatron.core", reason="the glue needs megatron-core")
    import argparse

    from megatron_ring.megatron import add_context_parallel_args

    parser = argparse.ArgumentParser()
    add_context_parallel_args(parser)
    options = {o for a in parser._actions for o in a.option_strings}
    named = {(_rel(p), f) for p in DOCS for f in re.findall(r"--cp-[a-z][a-z-]*[a-z]", _text(p))}
    assert named
    bad = sorted((doc, f) for doc, f in named if f not in options)
    assert not bad, f"--cp-* flags in the docs that add_context_parallel_args does not define: {bad}"


def test_documented_test_names_exist():
    """``tests/x.py::name`` and backticked ``test_...`` names the docs cite are defined in the test tree."""
    defined = {}
    for p in (ROOT / "tests").rglob("*.py"):
        for m in re.finditer(r"^\s*def (\w+)\(", p.read_text(), re.M):
            defined.setdefault(m.group(1), set()).add(str(p.relative_to(ROOT)))
    bad = []
    for p in DOCS:
        text = _text(p)
        for m in re.finditer(r"(tests/[\w/]+\.py)::(\w+)", text):
            if m.group(1) not in defined.get(m.group(2), ()):
                bad.append((_rel(p), m.group(0)))
        bad += [(_rel(p), n) for n in re.findall(r"`(test_\w+)`", text) if n not in defined]
    assert not bad, f"tests the docs cite that do not exist: {bad}"


def test_python_m_in_code_examples_and_scripts_exist():
    """Docstrings, comments and usage lines in megatron_ring/, examples/ and scripts/ name real modules."""
    bad = set()
    for d in ("megatron_ring", "lab", "examples", "scripts"):
        for p in (ROOT / d).rglob("*"):
            if p.suffix not in (".py", ".sh") or not p.is_file():
                continue
            for m in MODULE_RE.finditer(p.read_text()):
                mod = m.group(1).rstrip(".")
                if mod.startswith(("megatron_ring", "torch", "pytest", "pip")) and importlib.util.find_spec(mod) is None:
                    bad.add((_rel(p), mod))
    assert not bad, f"`python -m` of modules that do not exist: {sorted(bad)}"


def test_dotted_names_in_code_comments_and_docstrings_resolve():
    """``megatron_ring.x.y`` named in the library's, examples' and scripts' own text resolves (catches names
    left behind by a move, like a comment pointing to a module that is gone)."""
    pytest.importorskip("megatron.core", reason="the glue's names need megatron-core")
    names = set()
    for d in ("megatron_ring", "lab", "examples", "scripts"):
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".sh") and p.is_file():
                names |= {(_rel(p), m.group(1).rstrip(".")) for m in DOTTED_RE.finditer(p.read_text())}
    bad = sorted((f, n) for f, n in names if not _resolves(n))
    assert not bad, f"dotted names in code/comments that are neither a module nor an attribute: {bad}"


def test_documented_imports_work():
    """``from X import a, b`` lines in the docs (code and prose) name real modules and names."""
    pytest.importorskip("megatron.core", reason="the glue's names need megatron-core")
    bad = []
    for p in DOCS:
        for m in re.finditer(r"from ((?:megatron_ring|tests)(?:\.\w+)*) import (\([^)]*\)|[\w, ]+)", _text(p)):
            for name in (n.strip() for n in m.group(2).strip("()").replace("\n", " ").split(",")):
                if name and not _resolves(f"{m.group(1)}.{name}"):
                    bad.append((_rel(p), f"from {m.group(1)} import {name}"))
    assert not bad, f"imports in the docs that fail: {bad}"


def test_configuration_table_defaults_are_the_parser_defaults():
    """docs/configuration.md's flag table: every flag with its default ``(x)`` as add_context_parallel_args has it."""
    pytest.importorskip("megatron.core", reason="the glue needs megatron-core")
    import argparse

    from megatron_ring.megatron import add_context_parallel_args

    parser = argparse.ArgumentParser()
    add_context_parallel_args(parser)
    defaults = {o: a.default for a in parser._actions for o in a.option_strings}
    rows = re.findall(r"^\| `(--[\w-]+)` \| (.*?) \|", _text(ROOT / "docs" / "configuration.md"), re.M)
    assert len(rows) >= 6, rows
    bad = []
    for flag, values in rows:
        shown = re.findall(r"\(([^()]*)\)\s*$", values)
        assert shown, f"{flag}: no '(default)' at the end of {values!r}"
        doc = shown[0].strip("`")
        real = defaults[flag]
        real = real[0] if isinstance(real, list) and len(real) == 1 else real
        if not (doc == "unset" and real is None) and doc != str(real):
            bad.append((flag, doc, real))
    assert not bad, f"defaults in docs/configuration.md that the parser does not have: {bad}"
