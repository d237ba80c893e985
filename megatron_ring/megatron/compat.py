"""The one place for megatron-core API differences across the supported range (0.16.1 - 0.19.x).

Every call into a Megatron function whose signature moved between releases goes through here, with
keyword arguments and feature detection (never version-number checks, never positional arguments):

* ``get_gpt_layer_local_spec``: 0.16 has ``moe_use_legacy_grouped_gemm`` between ``fp8`` and
  ``normalization``; 0.19 removed it (a positional call shifts every later argument);
  0.19 also hides the signature behind ``(*args, **kwargs)`` -> ``get_gpt_layer_local_submodules``.
* ``megatron.core.utils.get_batch_on_this_cp_rank``: 0.16 ``(batch)``; 0.19 ``(batch, is_hybrid_cp, cp_group=...)``.
* ``megatron.training`` ships in the megatron-core wheel from 0.19 (``has_megatron_training``).
* How a Megatron-LM builder uses ``--spec``: main / core_r0.19 build GPT models through ``GPTModelBuilder``
  (``megatron/training/models/gpt.py``), which calls the object with a ``GPTModelConfig``
  (``gpt_builder_calls_spec``, ``is_gpt_model_config``, ``default_gpt_layer_spec``); core_v0.16 hands it to
  ``GPTModel`` as it is.
* Where Megatron-LM rebuilds the multi-token-prediction block from its own layer specs
  (``MTP_BLOCK_BUILDERS``) and which modules compute the MTP token count (``MTP_ROLL_TENSOR_USERS``).
* Which modules look TransformerEngine's ``thd_get_partitioned_indices`` up as their global ``tex``
  (``THD_PARTITIONER_USERS``: Mamba's CP undo/redo, Megatron's own THD batch split) and how a pure-torch
  stand-in is put there where TE is missing (:func:`install_tex_stand_in`; the stand-in comes from
  :mod:`megatron_ring.megatron.data.token_order`, whose ``install_thd_partitioner`` the CPU opt-in calls).
* The hybrid stack: 0.19 / main ``models/hybrid`` (``HybridStack``, ``hybrid_stack_spec``), 0.16
  ``ssm/mamba_block.MambaStack`` and ``models/mamba`` (``mamba_stack_spec``) (``hybrid_stack_class``,
  ``megatron_hybrid_stack_spec``); whether TransformerEngine is installed (``has_transformer_engine``); the
  local norm and MoE specs that stand in for TE's (``local_norm_class``, ``local_moe_spec``).
* QK-clip (``--qk-clip`` / ``--log-max-attention-logit``, megatron-core 0.16.1 - 0.19.x and main: the config fields
  ``qk_clip`` / ``log_max_attention_logit``, ``megatron.core.optimizer.qk_clip`` reading the core attention's
  ``current_max_attn_logits``): whether a call asks for it (``qk_clip_requested``), whether this line has it
  (``has_qk_clip``), and Megatron-LM's argument check, which asks ``is_te_min_version("2.9.0")`` (the TE release
  that returns max logits) for both flags: ``qk_clip_te_check`` answers it for the ring where TE is missing.
* How Megatron-LM's stock ``get_batch`` (``pretrain_gpt.py`` / ``pretrain_hybrid.py``, main and core_r0.19)
  split a packed (THD) batch over CP (``megatron_lm_packed_split``): ``--dataloader-inter-document-masking``
  without ``--sft`` passes ``use_per_sequence_balancing=True`` (one zigzag over the whole packed stream);
  otherwise (``--sft``) every document is split zigzag on its own.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import types
from typing import Any, Callable

__all__ = ["mcore_version", "accepted_kwargs", "call_with_supported_kwargs", "gpt_layer_local_spec",
           "megatron_get_batch_on_this_cp_rank", "has_megatron_training", "run_pretrain", "gpt_builder_calls_spec",
           "is_gpt_model_config", "default_gpt_layer_spec", "MTP_BLOCK_BUILDERS", "loaded_mtp_block_builders",
           "MTP_ROLL_TENSOR_USERS", "THD_PARTITIONER_USERS", "install_tex_stand_in",
           "has_transformer_engine", "hybrid_stack_class", "megatron_hybrid_stack_spec",
           "local_norm_class", "local_moe_spec", "megatron_lm_args", "megatron_lm_packed_split",
           "QK_CLIP_FLAGS", "qk_clip_requested", "has_qk_clip", "qk_clip_te_check",
           "qk_clip_passes_layers_without_attention", "KNOWN_ISSUE_RELEASES", "known_issue_affects"]


@functools.lru_cache(maxsize=1)
def mcore_version() -> tuple[int, ...]:
    """megatron-core's version as integers, e.g. ``(0, 19, 2)`` (informational; code uses feature detection).

    Read from ``megatron/core/package_info.py`` of the ``megatron`` that ``import megatron`` would load (the wheel
    or a checkout on the path), as constants, without importing ``megatron.core``: its ``__init__`` imports most of
    megatron-core (about 8 s of CPU on 2 cores), which a process that only asks for the version (the doctor's CLI)
    does not need. Where ``megatron.core`` is imported already, or the file's constants cannot be read, its
    ``package_info`` module answers. ``ImportError`` where there is no megatron-core."""
    if "megatron.core" not in sys.modules:
        found = _package_info_constants()
        if found is not None:
            return found
    from megatron.core import package_info

    return tuple(int(x) for x in (package_info.MAJOR, package_info.MINOR, package_info.PATCH))


def _package_info_constants() -> tuple[int, int, int] | None:
    """MAJOR, MINOR, PATCH as ``megatron/core/package_info.py`` assigns them (int literals), found on the path
    ``import megatron`` searches; None where that file or one of them is not there."""
    import ast

    spec = importlib.util.find_spec("megatron")  # a top-level name: nothing is imported
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "core", "package_info.py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        got = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name) and t.id in ("MAJOR", "MINOR", "PATCH")
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)}
        return (got["MAJOR"], got["MINOR"], got["PATCH"]) if len(got) == 3 else None
    return None


#: known Megatron CP issues (the doctor's ``--static`` list, lab/megatron_ring_lab/doctor/static.py): per reference,
#: (first affected megatron-core release, first fixed release or None). "First affected" is the oldest release
#: it was seen in here, not necessarily where it began; (0, 0, 0): every release.
KNOWN_ISSUE_RELEASES: dict[str, tuple[tuple[int, int, int], tuple[int, int, int] | None]] = {
    "NVIDIA/Megatron-LM#3959": ((0, 19, 0), None),
    "NVIDIA/Megatron-LM#5047": ((0, 0, 0), None),
    "NVIDIA-NeMo/Megatron-Bridge#2952": ((0, 0, 0), None),
    "NVIDIA/Megatron-LM#7452": ((0, 0, 0), None),
}


def known_issue_affects(ref: str, version: tuple[int, ...] | None) -> bool | None:
    """Whether megatron-core ``version`` is in the affected range of known issue ``ref`` (None: no version)."""
    first, fixed = KNOWN_ISSUE_RELEASES[ref]
    if version is None:
        return None
    return tuple(version) >= first and (fixed is None or tuple(version) < fixed)


def accepted_kwargs(fn: Callable, *fallbacks: Callable) -> frozenset[str] | None:
    """Keyword names ``fn`` accepts; if it only has ``*args, **kwargs``, those of the first fallback that
    names its parameters. ``None`` means "anything" (no named parameters found)."""
    for f in (fn, *fallbacks):
        params = inspect.signature(f).parameters.values()
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if named:
            return frozenset(named)
    return None


def call_with_supported_kwargs(fn: Callable, kwargs: dict[str, Any], *, defaults: dict[str, Any],
                               fallbacks: tuple[Callable, ...] = ()) -> Any:
    """Call ``fn(**kwargs)`` keeping only the keywords this megatron-core accepts.

    A keyword the installed version lacks is dropped when its value is the documented default in
    ``defaults`` (it cannot change the result) and raises ``TypeError`` otherwise (never silently ignored).
    """
    names = accepted_kwargs(fn, *fallbacks)
    if names is None:
        return fn(**kwargs)
    kept = {}
    for k, v in kwargs.items():
        if k in names:
            kept[k] = v
        elif k in defaults and v == defaults[k]:
            continue
        else:
            raise TypeError(f"{getattr(fn, '__qualname__', fn)} of this megatron-core "
                            f"({'.'.join(map(str, mcore_version()))}) has no argument {k!r} (got {k}={v!r})")
    return fn(**kept)


#: keywords of get_gpt_layer_local_spec that some supported release lacks, with their no-op value
_LOCAL_SPEC_OPTIONAL = {"moe_use_legacy_grouped_gemm": False, "qk_l2_norm": False, "fp8": None,
                        "experimental_attention_variant": None, "use_kitchen": False}


def gpt_layer_local_spec(**kwargs: Any) -> Any:
    """``get_gpt_layer_local_spec(**kwargs)`` on any supported megatron-core (keywords only)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    fallbacks = tuple(f for f in (getattr(specs, "get_gpt_layer_local_submodules", None),) if f is not None)
    return call_with_supported_kwargs(specs.get_gpt_layer_local_spec, kwargs, defaults=_LOCAL_SPEC_OPTIONAL,
                                      fallbacks=fallbacks)


def megatron_get_batch_on_this_cp_rank(batch: dict[str, Any], cp_group: Any = None) -> dict[str, Any]:
    """Megatron's own zigzag CP split of a batch (``megatron.core.utils.get_batch_on_this_cp_rank``)."""
    from megatron.core import utils as mutils

    fn = mutils.get_batch_on_this_cp_rank
    names = accepted_kwargs(fn) or frozenset()
    kwargs: dict[str, Any] = {}
    if "is_hybrid_cp" in names:
        kwargs["is_hybrid_cp"] = False
    if "cp_group" in names and cp_group is not None:
        kwargs["cp_group"] = cp_group
    return fn(batch, **kwargs)


@functools.lru_cache(maxsize=1)
def has_megatron_training() -> bool:
    """Whether Megatron-LM's ``megatron.training`` (argument parser, ``pretrain()``) is importable."""
    try:
        importlib.import_module("megatron.training")
    except Exception:  # ImportError, or its own import-time failures on a partial install
        return False
    return True


def megatron_lm_args() -> Any:
    """Megatron-LM's parsed arguments where a Megatron-LM script set them (``megatron.training``'s global
    args), else None (Megatron-Core used directly, or no ``megatron.training``). Never imports it."""
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None


def megatron_lm_packed_split(args: Any = None) -> str:
    """How the stock Megatron-LM ``get_batch`` split a packed (THD) batch over CP: ``"sequence"`` (one zigzag
    of 2 x CP equal chunks over the whole flattened stream: ``--dataloader-inter-document-masking`` without
    ``--sft``, main's and core_r0.19's ``use_per_sequence_balancing``) or ``"document"`` (each document split
    zigzag on its own, TransformerEngine's ``thd_get_partitioned_indices``: ``--sft``, and every caller that
    is not a Megatron-LM script). ``args``: Megatron-LM's arguments (default :func:`megatron_lm_args`)."""
    args = megatron_lm_args() if args is None else args
    if args is not None and getattr(args, "dataloader_inter_document_masking", False) \
            and not getattr(args, "sft", False):
        return "sequence"
    return "document"


def run_pretrain(pretrain: Callable, datasets_provider: Callable, model_provider: Callable, model_type: Any,
                 forward_step: Callable, *, extra_args_provider: Callable | None = None,
                 args_defaults: dict | None = None, **kwargs: Any) -> Any:
    """Megatron-LM's ``pretrain()`` with a model provider, on either of its signatures.

    0.19: ``pretrain(cfg_container, datasets_provider, model_type, forward_step, model_provider=...)`` after
    ``parse_and_validate_args``; up to 0.16: ``pretrain(datasets_provider, model_provider, model_type,
    forward_step, extra_args_provider=..., args_defaults=...)`` (it parses the arguments itself).
    """
    params = inspect.signature(pretrain).parameters
    if "cfg_container" in params:
        import warnings

        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults or {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "use a ModelConfig instead of a model provider": we need the provider
            container = pretrain_cfg_container_from_args(args, None)
        return pretrain(container, datasets_provider, model_type, forward_step, model_provider=model_provider,
                        **kwargs)
    return pretrain(datasets_provider, model_provider, model_type, forward_step,
                    extra_args_provider=extra_args_provider, args_defaults=args_defaults or {}, **kwargs)


def gpt_builder_calls_spec() -> bool:
    """Whether this Megatron-LM builds GPT models through ``GPTModelBuilder`` (main, core_r0.19+), which
    calls a ``--spec`` callable with the config. Looks for ``megatron/training/models/gpt.py`` in the
    ``megatron.training`` Python would import, without importing it (core_v0.16 has no such file; a
    megatron-core wheel without ``megatron.training`` has none either)."""
    try:
        found = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return False
    places = getattr(found, "submodule_search_locations", None) or []
    return any(os.path.isfile(os.path.join(p, "models", "gpt.py")) for p in places)


def is_gpt_model_config(config: Any) -> bool:
    """Whether ``config`` is Megatron-LM main / core_r0.19's ``GPTModelConfig`` (it holds the
    ``TransformerConfig`` as ``.transformer``), not a ``TransformerConfig``."""
    return hasattr(config, "transformer")


def default_gpt_layer_spec(config: Any, vp_stage: int | None) -> Any:
    """The layer/block spec ``GPTModelBuilder`` builds for a ``GPTModelConfig`` (main / core_r0.19)."""
    from megatron.training.models.gpt import default_layer_spec

    return default_layer_spec(config, vp_stage)


#: Megatron-LM's builders of the multi-token-prediction block, (module, function): main / r0.19, and the
#: top-level ``gpt_builders`` of the core_v0.16 / v0.19 tags
MTP_BLOCK_BUILDERS = (("megatron.training.models.gpt", "mtp_block_spec"), ("gpt_builders", "get_gpt_mtp_block_spec"))

#: the Megatron modules whose global ``roll_tensor`` computes the MTP token count (0.19/main; 0.16)
MTP_ROLL_TENSOR_USERS = ("megatron.core.transformer.multi_token_prediction", "megatron.core.models.gpt.gpt_model")


def loaded_mtp_block_builders() -> list[tuple[Any, str]]:
    """The (module, function name) pairs of :data:`MTP_BLOCK_BUILDERS` whose module is loaded, after importing
    ``megatron.training.models.gpt`` where it exists (``gpt_builders`` is never imported)."""
    try:
        import megatron.training.models.gpt  # noqa: F401
    except ImportError:
        pass
    return [(sys.modules[m], name) for m, name in MTP_BLOCK_BUILDERS if m in sys.modules]


#: Modules whose global ``tex`` (``transformer_engine_torch``, None without TE) Megatron asks for
#: ``thd_get_partitioned_indices``; each gates that branch with ``is_te_min_version("1.10.0")``.
THD_PARTITIONER_USERS = ("megatron.core.ssm.mamba_context_parallel", "megatron.core.utils")


def install_tex_stand_in(stand_in: Any, patch: Callable[[Any, str, Any], None]) -> dict[str, str]:
    """In each of ``THD_PARTITIONER_USERS`` whose ``tex`` is None, put ``stand_in``, and make the
    module's ``is_te_min_version`` answer True to that branch's question (``"1.10.0"``) while the stand-in is
    there (any other question goes to Megatron's own). Where TE is installed nothing changes. Idempotent.
    ``patch(module, name, value)`` sets each name (no default: the caller owns the change and its undoing).
    Returns ``{module: "transformer_engine" | "torch" | "absent"}``."""
    out = {}
    for name in THD_PARTITIONER_USERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            out[name] = "absent"
            continue
        tex = getattr(mod, "tex", None)
        if stand_in is not None and tex is stand_in:
            out[name] = "torch"
        elif tex is not None:
            out[name] = "transformer_engine"
        elif stand_in is None or not hasattr(mod, "tex"):
            out[name] = "absent"
        else:
            patch(mod, "is_te_min_version", _stand_in_version_check(mod, stand_in,
                                                                    getattr(mod, "is_te_min_version", None)))
            patch(mod, "tex", stand_in)
            out[name] = "torch"
    return out


def _stand_in_version_check(mod: Any, stand_in: Any, original: Any) -> Callable:
    def is_te_min_version(version, check_equality=True):
        if mod.tex is stand_in and str(version) == "1.10.0":  # the THD branch: is the function there
            return True
        if original is None:
            raise ImportError("transformer_engine is not installed")
        return original(version, check_equality)
    return is_te_min_version


@functools.lru_cache(maxsize=1)
def has_transformer_engine() -> bool:
    """Whether TransformerEngine is installed (megatron-core's own ``HAVE_TE``)."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def hybrid_stack_class() -> Any:
    """Megatron's hybrid stack class: ``HybridStack`` (``models/hybrid``, 0.19 / main) or ``MambaStack``
    (0.16); ``None`` if neither exists."""
    for module, name in (("megatron.core.models.hybrid.hybrid_block", "HybridStack"),
                         ("megatron.core.ssm.mamba_block", "MambaStack")):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def megatron_hybrid_stack_spec() -> Any:
    """Megatron's own (TransformerEngine) hybrid stack spec: ``hybrid_stack_spec`` (0.19 / main) or
    ``mamba_stack_spec`` (0.16)."""
    try:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        return hybrid_stack_spec
    except ImportError:
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

        return mamba_stack_spec


def local_norm_class() -> Any:
    """Megatron's local norm module, which follows ``config.normalization`` (LayerNorm / RMSNorm)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def local_moe_spec() -> Any:
    """Megatron's local MoE module spec (sequential experts), as its local GPT spec builds it."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return call_with_supported_kwargs(get_moe_module_spec, dict(use_te=False, num_experts=8, moe_grouped_gemm=False),
                                      defaults={})


#: QK-clip's config fields and their flags (megatron-core 0.16.1 - 0.19.x, main)
QK_CLIP_FLAGS = (("qk_clip", "--qk-clip"), ("log_max_attention_logit", "--log-max-attention-logit"))
#: the TransformerEngine release Megatron-LM's argument check asks for with either flag (``return_max_logit``)
QK_CLIP_TE_VERSION = "2.9.0"
#: the module of Megatron-LM whose ``is_te_min_version`` makes that check
QK_CLIP_TE_CHECKER = "megatron.training.arguments"


def qk_clip_requested(config: Any) -> str | None:
    """The flag of the first QK-clip option ``config`` turns on (``--qk-clip``, ``--log-max-attention-logit``), or
    None: then the core attention computes no max logit."""
    for field, flag in QK_CLIP_FLAGS:
        if getattr(config, field, False):
            return flag
    return None


@functools.lru_cache(maxsize=1)
def has_qk_clip() -> bool:
    """Whether this megatron-core reads ``current_max_attn_logits`` (``megatron.core.optimizer.qk_clip``)."""
    try:
        return importlib.util.find_spec("megatron.core.optimizer.qk_clip") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def qk_clip_passes_layers_without_attention() -> bool:
    """Whether this megatron-core's ``clip_qk`` passes over decoder layers that have no ``self_attention`` (the
    Mamba layers of a hybrid stack). Asked of ``clip_qk`` itself: it runs (``log_max_only``, no attention layer,
    so no collective) on a stand-in model whose one layer has no ``self_attention``, reachable as Megatron walks
    it (``chunk.module.module.decoder.layers``, or unwrapped). megatron-core 0.19.x and Megatron-LM main (through
    d98e8a6, Aug 2026) read ``layer.self_attention`` on every layer: AttributeError, so False there."""
    try:
        from megatron.core.optimizer.qk_clip import clip_qk
    except ImportError:
        return False
    layer = types.SimpleNamespace()  # no self_attention, as MambaLayer
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    model.module = model  # every depth of .module wrapping resolves to the model
    try:
        clip_qk([model], log_max_only=True)
    except Exception:  # noqa: BLE001 - AttributeError on the lines above; anything else: not shown to pass
        return False
    return True


def qk_clip_te_check(original: Callable | None) -> Callable:
    """Megatron-LM's ``is_te_min_version`` as the ring answers it where TransformerEngine is missing: the argument
    check of ``--qk-clip`` / ``--log-max-attention-logit`` asks for TE >= 2.9.0 because that is the attention that
    returns the max logit; with the ring named by ``--spec`` (``megatron_ring...``) the core attention is the ring,
    which returns it, so that question is answered True. Every other question, and this one without the ring's
    spec or with TE installed, goes to ``original`` (Megatron's own answer)."""
    def is_te_min_version(version, check_equality=True):
        if str(version) == QK_CLIP_TE_VERSION and not has_transformer_engine() and _ring_spec_named(sys.argv):
            return True
        if original is None:
            raise ImportError("transformer_engine is not installed")
        return original(version, check_equality)
    is_te_min_version.ring_answers = QK_CLIP_TE_VERSION
    return is_te_min_version


def _ring_spec_named(argv: list[str]) -> bool:
    """Whether ``--spec`` on Megatron-LM's command line names a megatron_ring spec module."""
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--spec=") else (argv[i + 1] if a == "--spec" and i + 1 < len(argv)
                                                                   else None)
        if value is not None and value.split(".", 1)[0] == "megatron_ring":
            return True
    return False
