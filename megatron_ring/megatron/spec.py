"""Ring attention in stock Megatron-LM and Megatron-Bridge, with one line and no patch.

Stock Megatron-LM (``pretrain_gpt.py``)::

    --spec megatron_ring.megatron.spec ring_layer_spec

* Megatron-LM main and core_r0.19 (``GPTModelConfig`` -> ``GPTModelBuilder``): ``ring_layer_spec`` is a
  callable ``ring_layer_spec(config, vp_stage=None)`` returning the spec Megatron would build for this
  config (local or TransformerEngine, dense or MoE, heterogeneous) with only core attention swapped; the
  multi-token-prediction block Megatron rebuilds from its own layer specs gets ring attention too.
* Megatron-LM core_v0.16.1 (``gpt_builders.gpt_builder``) hands the ``--spec`` object to ``GPTModel`` as it
  is, so there the same name is a layer ``ModuleSpec`` (:data:`ring_layer_module_spec`) whose module,
  :class:`RingTransformerLayer`, defers everything to layer build time: each layer is built from Megatron's
  own spec for the config it is given (dense layer spec, or this stage's entry of the MoE block spec) with
  only core attention swapped. It is still callable as ``ring_layer_spec(config, vp_stage=None)``.
  Which of the two ``ring_layer_spec`` is depends on whether this Megatron-LM has ``GPTModelBuilder``
  (``megatron/training/models/gpt.py``, looked up without importing it). Refused by name in this form:
  heterogeneous layer configs (each layer gets a derived config), an MoE block whose final norm would
  differ from ``TransformerBlock``'s ``LayerNormImpl`` (TransformerEngine installed with the local
  implementation), and multi-token prediction where the builder builds the MTP block from Megatron's own
  layer spec (unless :func:`install_mtp_ring_attention` wrapped that builder). core_v0.16.1's own
  ``gpt_builder`` cannot combine any ``--spec`` with ``--mtp-num-layers`` anyway (``use_te`` is unbound,
  gpt_builders.py:84).

Megatron-Bridge (any GPT provider)::

    cfg.model.transformer_layer_spec = ring_spec(cfg.model.transformer_layer_spec)

What stock Megatron does at CP > 1 is exactly what the ring needs for the zigzag layout: it splits each
sequence zigzag (``get_batch_on_this_cp_rank``), slices RoPE the same way, sums the loss over CP and
averages gradients over DP x CP. The CP group is taken from Megatron at each call. Options a stock script
cannot pass as flags come from ``MEGATRON_RING_*`` environment variables (:mod:`.env`). Other layouts,
and packed (THD) batches at CP > 1, need a batch split and RoPE stock Megatron does not do: they are
refused by name, pointing to ``examples/pretrain_ring_gpt.py`` or the patch.

Megatron's ``import_module`` (used by ``--spec``) swallows an ``ImportError`` and falls back to its default
spec, so at import this module only defines things (it needs ``ModuleSpec`` and ``BaseTransformerLayer``,
which the package's own imports of megatron-core have loaded already); everything that depends on the
config, and every refusal, happens when the spec or a layer is built. One line at start-up (rank 0) says
which core attention the layers got.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

__all__ = ["ring_layer_spec", "ring_layer_spec_provider", "ring_layer_module_spec", "RingLayerSpec",
           "RingTransformerLayer", "ring_spec", "describe_core_attention", "install_mtp_ring_attention"]


def _ring_core() -> Any:
    """Core attention for specs run by stock Megatron: batches split by Megatron (zigzag)."""
    from megatron_ring.megatron.attention import RingDotProductAttention

    return ModuleSpec(module=RingDotProductAttention, params={"batch_split": "megatron"})


def _check_stock_layout() -> None:
    from megatron_ring.megatron.config import ContextParallelConfigError
    from megatron_ring.megatron.env import ring_config_from_env
    from megatron_ring.megatron.provider import get_ring_state, is_context_parallel_initialized

    cfg = get_ring_state().config if is_context_parallel_initialized() else ring_config_from_env()
    if cfg.layout != "zigzag":
        raise ContextParallelConfigError(
            "MEGATRON_RING_LAYOUT", f"layout {cfg.layout!r} needs a batch split and RoPE that stock Megatron does "
                                    "not do (it splits zigzag); use zigzag with --spec / ring_spec, or run "
                                    "examples/pretrain_ring_gpt.py --cp-layout ... or the patch in patches/")


def _swap(spec: Any) -> Any:
    from megatron_ring.megatron.layer_spec import with_ring_attention

    _check_stock_layout()
    return with_ring_attention(spec, _ring_core())


def _transformer(config: Any) -> Any:
    """The ``TransformerConfig`` inside a ``GPTModelConfig`` (or the config itself)."""
    return getattr(config, "transformer", config)


def _megatron_default_spec(config: Any, vp_stage: int | None) -> Any:
    """The layer/block spec Megatron builds for ``config`` (``GPTModelConfig`` or ``TransformerConfig``)."""
    if hasattr(config, "transformer"):  # Megatron-LM main / core_r0.19: GPTModelConfig
        from megatron.training.models.gpt import default_layer_spec

        return default_layer_spec(config, vp_stage)
    return _spec_from_transformer_config(config, vp_stage)


def _spec_from_transformer_config(tc: Any, vp_stage: int | None, pp_rank: int | None = None) -> Any:
    """What Megatron's GPT builders choose for a ``TransformerConfig``: MoE block, heterogeneous, or layer."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_ring.megatron import compat

    use_te = getattr(tc, "transformer_impl", "local") == "transformer_engine"
    if getattr(tc, "experimental_attention_variant", None) is not None:
        raise NotImplementedError("ring_layer_spec: experimental attention variants have their own core "
                                  "attention; ring attention replaces dot-product attention only")
    if getattr(tc, "use_kitchen", False) or getattr(tc, "transformer_impl", None) == "inference_optimized":
        raise NotImplementedError("ring_layer_spec: kitchen and inference-optimized layers have their own Megatron "
                                  "spec builders, which this one does not rebuild; wrap that spec with "
                                  "ring_spec(...) in a model provider instead")
    if getattr(tc, "num_moe_experts", None):
        return compat.call_with_supported_kwargs(
            specs.get_gpt_decoder_block_spec, dict(config=tc, use_transformer_engine=use_te,
                                                   normalization=tc.normalization,
                                                   qk_l2_norm=getattr(tc, "qk_l2_norm", False), vp_stage=vp_stage,
                                                   pp_rank=pp_rank),
            defaults={"pp_rank": None})
    if type(tc).__name__ == "HeterogeneousTransformerConfig":
        from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

        return get_gpt_heterogeneous_layer_spec(tc, use_te)
    kwargs = dict(num_experts=None, moe_grouped_gemm=False, qk_layernorm=tc.qk_layernorm,
                  multi_latent_attention=tc.multi_latent_attention, qk_l2_norm=getattr(tc, "qk_l2_norm", False))
    if use_te:
        return compat.call_with_supported_kwargs(specs.get_gpt_layer_with_transformer_engine_spec, kwargs,
                                                 defaults={})
    return compat.gpt_layer_local_spec(normalization=tc.normalization, **kwargs)


_MTP_CORE: list[Any] = []  # the core attention the wrapped MTP builders swap in (set by the last installer)

#: Megatron-LM's builders of the multi-token-prediction block, (module, function): main / r0.19, and the
#: top-level ``gpt_builders`` of the core_v0.16 / v0.19 tags
_MTP_BUILDERS = (("megatron.training.models.gpt", "mtp_block_spec"), ("gpt_builders", "get_gpt_mtp_block_spec"))


def _mtp_builders() -> list[tuple[Any, str]]:
    """The (module, function name) pairs of :data:`_MTP_BUILDERS` whose module is loaded, after importing
    ``megatron.training.models.gpt`` where it exists (``gpt_builders`` is never imported)."""
    try:
        import megatron.training.models.gpt  # noqa: F401
    except ImportError:
        pass
    return [(sys.modules[m], name) for m, name in _MTP_BUILDERS if m in sys.modules]


def _ring_mtp(core: Any = None) -> None:
    """Give multi-token-prediction layers ring attention: Megatron rebuilds the MTP block from its own
    layer specs (:data:`_MTP_BUILDERS`), not from ``--spec``. Wraps those builders once (idempotent).
    ``core``: the core attention to swap in (default: the stock-split ring core attention)."""
    _MTP_CORE[:] = [core if core is not None else _ring_core()]
    for module, name in _mtp_builders():
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, "_megatron_ring", False):
            continue

        def wrapped(*args: Any, __fn: Callable = fn, **kwargs: Any) -> Any:
            out = __fn(*args, **kwargs)
            if out is None:
                return out
            from megatron_ring.megatron.layer_spec import with_ring_attention
            from megatron_ring.megatron.mtp import apply_mtp_loss_choice

            _check_stock_layout()
            out = with_ring_attention(out, _MTP_CORE[0])
            config = args[0] if args else kwargs.get("config")
            note = apply_mtp_loss_choice(getattr(_transformer(config), "context_parallel_size", 1) or 1)
            _announce("multi-token prediction", out, config, note=note)
            return out

        wrapped._megatron_ring = True  # type: ignore[attr-defined]
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(module, name, wrapped)


def install_mtp_ring_attention(core: Any = None) -> None:
    """Make Megatron-LM's rebuilt multi-token-prediction block use ring attention (see :func:`_ring_mtp`)."""
    _ring_mtp(core)


def describe_core_attention(spec: Any) -> str:
    """``"RingDotProductAttention x2, DotProductAttention x1"``: the core attentions named in a spec tree."""
    import dataclasses

    seen: dict[str, int] = {}

    def walk(node: Any, memo: set) -> None:
        if id(node) in memo:
            return
        memo.add(id(node))
        if isinstance(node, (list, tuple)):
            for x in node:
                walk(x, memo)
        elif isinstance(node, ModuleSpec):
            core = getattr(node.submodules, "core_attention", None) if node.submodules is not None else None
            if core is not None:
                mod = core.module if isinstance(core, ModuleSpec) else core
                name = getattr(mod, "__name__", type(mod).__name__)
                seen[name] = seen.get(name, 0) + 1
            else:
                walk(node.submodules, memo)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), memo)

    walk(spec, set())
    return ", ".join(f"{k} x{v}" for k, v in seen.items()) or "none"


def _announce(where: str, spec: Any, config: Any, note: str = "") -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from megatron_ring.megatron.env import ring_config_from_env
    from megatron_ring.megatron.provider import get_ring_state, is_context_parallel_initialized

    cfg = get_ring_state().config if is_context_parallel_initialized() else ring_config_from_env()
    tc = _transformer(config)
    from megatron_ring.megatron.config import normalize_comm_type

    model_ct = normalize_comm_type(getattr(tc, "cp_comm_type", None))  # Megatron's --cp-comm-type wins
    comm = (model_ct if isinstance(model_ct, str) else ",".join(model_ct)) if model_ct else ",".join(cfg.cp_comm_type)
    print(f"> megatron_ring ({where}): core attention of the layer spec: {describe_core_attention(spec)} "
          f"(CP={getattr(tc, 'context_parallel_size', '?')}, layout {cfg.layout}, wire {cfg.comm_dtype}, "
          f"comm {comm}; CP group from Megatron at each call){'; ' + note if note else ''}", flush=True)


def ring_layer_spec_provider(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's own spec for ``config`` with ring attention as core attention: ``--spec
    megatron_ring.megatron.spec ring_layer_spec`` on Megatron-LM main / core_r0.19 (``GPTModelBuilder``
    calls it with the ``GPTModelConfig``), or any builder that calls ``f(config, vp_stage=...)`` with a
    ``TransformerConfig``."""
    spec = _swap(_megatron_default_spec(config, vp_stage))
    _ring_mtp()
    _announce("--spec ring_layer_spec", spec, config)
    return spec


def _refuse_unswapped_mtp(tc: Any) -> None:
    """The deferred layer cannot reach the multi-token-prediction block: a builder that uses the spec as it
    is builds that block from Megatron's own layer spec first. Refused unless that builder was wrapped."""
    if not getattr(tc, "mtp_num_layers", None):
        return
    for module_name, fn_name in _MTP_BUILDERS:
        fn = getattr(sys.modules.get(module_name), fn_name, None)
        if fn is not None and not getattr(fn, "_megatron_ring", False):
            raise NotImplementedError(
                f"--mtp-num-layers {tc.mtp_num_layers} with --spec megatron_ring.megatron.spec ring_layer_spec: "
                f"this Megatron-LM ({module_name}.{fn_name}) builds the multi-token-prediction block from its own "
                "layer spec before any layer exists, so those layers would keep Megatron's core attention. "
                "Call megatron_ring.megatron.spec.install_mtp_ring_attention() after gpt_builders is imported, "
                "or run without --mtp-num-layers")


def _pp_rank(pg_collection: Any) -> int | None:
    pp = getattr(pg_collection, "pp", None)
    if pp is None:
        return None
    from megatron.core.utils import get_pg_rank

    return get_pg_rank(pp)


def _resolve_layer(config: Any, layer_number: int, vp_stage: int | None, pg_collection: Any) -> Any:
    """This layer's spec: Megatron's spec for ``config`` with ring core attention; from a block spec (MoE)
    the entry of this pipeline stage's layer list (Megatron's layer offset is already applied to it)."""
    from megatron.core.transformer import transformer_block as tb

    if getattr(config, "heterogeneous_block_specs", False):
        raise NotImplementedError(
            "ring_layer_spec as a layer ModuleSpec (Megatron-LM core_v0.16 --spec): heterogeneous layer configs "
            "give each layer a derived config, from which Megatron's heterogeneous spec cannot be rebuilt; use "
            "ring_spec(get_gpt_heterogeneous_layer_spec(config, use_te)) in a model provider")
    _refuse_unswapped_mtp(config)
    pp_rank = _pp_rank(pg_collection)
    spec = _swap(_spec_from_transformer_config(config, vp_stage, pp_rank))
    if isinstance(spec, ModuleSpec):
        layer = spec
    else:  # TransformerBlockSubmodules: this stage's layers in order, TransformerBlock numbers them from 1
        # The block around this layer was built from a layer spec, so its final norm is TransformerBlock's
        # LayerNormImpl: equal to the block spec's norm except with TransformerEngine installed and the
        # local implementation; refuse that instead of building a different model.
        if spec.layer_norm is not tb.LayerNormImpl:
            raise NotImplementedError(
                f"ring_layer_spec as a layer ModuleSpec: Megatron's block spec for this config ends with "
                f"{getattr(spec.layer_norm, '__name__', spec.layer_norm)}, a block built from a layer spec with "
                f"{tb.LayerNormImpl.__name__}; use --transformer-impl transformer_engine, or ring_spec(...) on the "
                "block spec in a model provider")
        count = tb.get_num_layers_to_build(config, vp_stage, pp_rank)
        if len(spec.layer_specs) != count or not 1 <= layer_number <= count:
            raise RuntimeError(f"ring_layer_spec: Megatron's block spec lists {len(spec.layer_specs)} layers for "
                               f"this stage, the block builds {count}; layer {layer_number} cannot be matched")
        layer = spec.layer_specs[layer_number - 1]
    if layer_number == 1:
        _announce("--spec ring_layer_spec", spec, config)
    return layer


class RingTransformerLayer(BaseTransformerLayer):
    """The module of :data:`ring_layer_module_spec`: never an instance itself. Built as a layer
    (``config``, ``layer_number``, ``pg_collection``, ``vp_stage``, ... from ``TransformerBlock``), it
    returns the layer Megatron's own spec for that config describes, with ring core attention (a
    ``TransformerLayer``, or an MoE layer from the block spec), so the model holds only Megatron's modules."""

    def __new__(cls, config: Any = None, submodules: Any = None, layer_number: int = 1, **kwargs: Any) -> Any:
        if config is None:
            raise TypeError("RingTransformerLayer is built by TransformerBlock with a config (it is the module "
                            "of megatron_ring.megatron.spec.ring_layer_module_spec)")
        if submodules is not None:
            raise TypeError("RingTransformerLayer takes no submodules: it builds Megatron's own for the config")
        layer = _resolve_layer(config, layer_number, kwargs.get("vp_stage"), kwargs.get("pg_collection"))
        return build_module(layer, config=config, layer_number=layer_number, **kwargs)


class RingLayerSpec(ModuleSpec):
    """A layer ``ModuleSpec`` of :class:`RingTransformerLayer`, for builders that use a ``--spec`` object as
    it is (Megatron-LM core_v0.16 ``gpt_builders``: ``TransformerBlock`` repeats it once per layer of the
    stage). Called with ``(config[, vp_stage])`` it is :func:`ring_layer_spec_provider` (returns the spec);
    called with layer arguments it builds the layer, as any ``ModuleSpec``."""

    def __call__(self, config: Any, vp_stage: int | None = None, **layer_kwargs: Any) -> Any:
        if layer_kwargs:
            return build_module(self, config=config, vp_stage=vp_stage, **layer_kwargs)
        return ring_layer_spec_provider(config, vp_stage)


#: ``ring_layer_spec`` for builders that take the object as a spec (also callable like the provider).
ring_layer_module_spec = RingLayerSpec(module=RingTransformerLayer)


def _builder_calls_spec() -> bool:
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


#: ``--spec megatron_ring.megatron.spec ring_layer_spec``: the provider where ``GPTModelBuilder`` calls it,
#: the layer ``ModuleSpec`` where the builder uses it as it is (Megatron-LM core_v0.16, megatron-core alone).
ring_layer_spec: Any = ring_layer_spec_provider if _builder_calls_spec() else ring_layer_module_spec


def ring_spec(spec: Any) -> Any:
    """Megatron-Bridge's one line: ``cfg.model.transformer_layer_spec = ring_spec(cfg.model.transformer_layer_spec)``.

    ``spec``: a ``ModuleSpec`` / block spec (returned with core attention swapped), or a callable spec
    provider ``f(config[, vp_stage])`` (returned as a callable of the same form whose result is swapped).
    """
    if isinstance(spec, ModuleSpec) or hasattr(spec, "layer_specs") or not callable(spec):
        return _swap(spec)
    takes_vp = "vp_stage" in inspect.signature(spec).parameters

    if takes_vp:
        def provider(config: Any, vp_stage: int | None = None) -> Any:
            out = _swap(spec(config, vp_stage=vp_stage))
            _announce("ring_spec", out, config)
            return out
    else:
        def provider(config: Any) -> Any:  # type: ignore[misc]
            out = _swap(spec(config))
            _announce("ring_spec", out, config)
            return out
    provider.__name__ = f"ring_spec({getattr(spec, '__name__', type(spec).__name__)})"
    provider.__wrapped__ = spec  # type: ignore[attr-defined]
    return provider

