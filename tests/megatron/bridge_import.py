"""Import Megatron-Bridge on a machine without TransformerEngine (a CPU-lab measure for the tests only).

Megatron-Bridge 0.6.2 guards TransformerEngine (``try: import transformer_engine ... HAVE_TE = False``)
everywhere but one file: ``megatron/bridge/peft/lora_layers.py`` line 20 runs
``import transformer_engine.pytorch as te`` unguarded, and every ``import megatron.bridge.*`` reaches it
(package ``__init__`` -> model bridges -> ``models/conversion/peft_bridge.py`` -> ``peft/canonical_lora.py``
-> ``peft/lora_layers.py``). Its uses of ``te`` are LoRA code paths (and one return annotation,
``te.ops.Sequential``, evaluated when the class body runs); the GPT providers and the training step do not
use it.

:func:`import_bridge` satisfies exactly that one import statement and nothing else:

* a finder wraps the loader of ``megatron.bridge.peft.lora_layers`` only; while (and only while) that
  file's body runs, ``sys.modules`` holds a stand-in for ``transformer_engine`` and
  ``transformer_engine.pytorch``; it is removed as soon as the body has run, so every other module's
  ``import transformer_engine`` (Megatron-Core's and Bridge's guarded ones) still raises ``ImportError``
  and their ``HAVE_TE`` stays False;
* the other imports of ``lora_layers.py`` are made before the window opens, and the window checks that no
  module other than ``lora_layers`` itself was first imported inside it (so no other module can have seen
  the stand-in);
* the stand-in computes nothing: attribute lookups give placeholders (needed for the annotation), and
  calling one, ``isinstance``/``issubclass`` against one, truth-testing, iterating or entering one raises
  :class:`TransformerEngineStandInUsed`. A TransformerEngine code path can therefore never run silently;
* after the import, :func:`check_no_transformer_engine` asserts that ``transformer_engine`` is neither
  importable nor in ``sys.modules``, that megatron-core's ``HAVE_TE`` is False and that every loaded
  ``megatron.*`` module's ``HAVE_TE`` is False but for the few listed in :data:`DERIVED_FROM_MCORE_NAMES`
  (True with or without the stand-in; see there).

Where TransformerEngine is really installed, none of this is used: Bridge is imported as it is.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
#: what lora_layers.py imports besides transformer_engine (imported before the window opens)
LORA_LAYERS_DEPS = ("torch", "torch.nn", "megatron.core.transformer.moe.moe_utils",
                    "megatron.bridge.peft.adapter_wrapper", "megatron.bridge.peft.lora_merge")
#: Bridge modules whose ``HAVE_TE`` is True on any machine without TransformerEngine, stand-in or not: they
#: compute it with ``safe_import_from("megatron.core.extensions.transformer_engine", "TE...")``, and that
#: megatron-core module defines its ``TE*`` class names even without TransformerEngine (on a ``MagicMock``
#: base, with its own ``HAVE_TE = False``). They decide LoRA module matching and Gemma 4 specs only.
DERIVED_FROM_MCORE_NAMES = frozenset({
    "megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher",
    "megatron.bridge.models.gemma.modeling_gemma4", "megatron.bridge.models.gemma.gemma4_provider"})


class TransformerEngineStandInUsed(RuntimeError):
    """Raised by any use of the import-only TransformerEngine stand-in."""


def _refuse(what: str) -> TransformerEngineStandInUsed:
    return TransformerEngineStandInUsed(
        f"{what}: TransformerEngine is not installed; the stand-in that lets "
        f"{LORA_LAYERS} be imported (tests/megatron/bridge_import.py, a CPU-lab measure) computes nothing")


class _Placeholder:
    """``te.<name>``: may be looked up (an annotation), never used."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"call of {self._name}")

    def __instancecheck__(self, obj: Any) -> bool:
        raise _refuse(f"isinstance(..., {self._name})")

    def __subclasscheck__(self, cls: Any) -> bool:
        raise _refuse(f"issubclass(..., {self._name})")

    def __bool__(self) -> bool:
        raise _refuse(f"truth value of {self._name}")

    def __iter__(self) -> Any:
        raise _refuse(f"iteration over {self._name}")

    def __enter__(self) -> Any:
        raise _refuse(f"with {self._name}")

    def __exit__(self, *exc: Any) -> None:
        raise _refuse(f"with {self._name}")

    def __mro_entries__(self, bases: Any) -> Any:
        raise _refuse(f"subclassing {self._name}")

    def __repr__(self) -> str:
        return f"<TransformerEngine stand-in placeholder {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


def _stand_ins() -> dict[str, types.ModuleType]:
    top = _StandInModule("transformer_engine", "import-only stand-in (tests/megatron/bridge_import.py)")
    sub = _StandInModule("transformer_engine.pytorch", "import-only stand-in (tests/megatron/bridge_import.py)")
    top.__path__ = []  # a package, so the submodule import resolves
    top.pytorch = sub
    return {"transformer_engine": top, "transformer_engine.pytorch": sub}


class _WindowLoader(importlib.abc.Loader):
    """Runs lora_layers.py with the stand-in visible only during its body."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        for dep in LORA_LAYERS_DEPS:
            importlib.import_module(dep)
        before = set(sys.modules)
        stand = _stand_ins()
        clash = [n for n in stand if n in sys.modules]
        if clash:
            raise RuntimeError(f"{clash} already imported: refusing to stand in for TransformerEngine")
        sys.modules.update(stand)
        try:
            self.inner.exec_module(module)
        finally:
            for name in stand:
                sys.modules.pop(name, None)
        new = set(sys.modules) - before - {LORA_LAYERS}
        if new:
            raise RuntimeError(f"modules first imported while the TransformerEngine stand-in was visible: "
                               f"{sorted(new)}; add them to LORA_LAYERS_DEPS")


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WindowLoader(spec.loader)
        return spec


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def check_no_transformer_engine() -> None:
    """No TransformerEngine anywhere: not importable, not in ``sys.modules``, every ``HAVE_TE`` False."""
    assert "transformer_engine" not in sys.modules and "transformer_engine.pytorch" not in sys.modules
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        pass
    else:  # pragma: no cover - would mean the stand-in leaked
        raise AssertionError("transformer_engine became importable")
    te_ext = sys.modules.get("megatron.core.extensions.transformer_engine")
    assert te_ext is None or te_ext.HAVE_TE is False, "megatron-core took its TransformerEngine paths"
    bad = [name for name, mod in list(sys.modules.items())
           if name.startswith("megatron.") and getattr(mod, "HAVE_TE", False) is True
           and name not in DERIVED_FROM_MCORE_NAMES]
    assert not bad, f"modules that think TransformerEngine is there: {bad}"


def import_bridge(*modules: str) -> list[types.ModuleType]:
    """Import ``modules`` (e.g. ``megatron.bridge.training.gpt_step``); the lora_layers stand-in is used only
    where TransformerEngine is not installed."""
    if have_transformer_engine():
        return [importlib.import_module(m) for m in modules]
    importlib.import_module("megatron.core")
    finder = _LoraLayersFinder()
    sys.meta_path.insert(0, finder)
    try:
        out = [importlib.import_module(m) for m in modules]
    finally:
        sys.meta_path.remove(finder)
    check_no_transformer_engine()
    return out


def skip_without_bridge() -> None:
    """Skip the calling test module where Megatron-Bridge is not installed (pinned install:
    requirements/bridge-py312.txt, see docs/megatron-runs.md 'Megatron-Bridge')."""
    import pytest

    try:
        found = importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        pytest.skip("megatron-bridge is not installed (pinned install: requirements/bridge-py312.txt, see "
                    "docs/megatron-runs.md 'Megatron-Bridge')", allow_module_level=True)
