"""Ring attention in Megatron's hybrid stack (``HybridModel`` / ``MambaModel``), with one line and no patch.

Stock Megatron-LM ``pretrain_hybrid.py`` (main, core_r0.19; core_v0.16's ``pretrain_mamba.py``)::

    --spec megatron_ring.megatron.spec ring_hybrid_stack_spec --hybrid-layer-pattern 'M*M-'

(``pretrain_mamba.py`` takes the pattern as ``--hybrid-override-pattern 'M*M-' --num-layers 4``; its patterns
know ``M``, ``*``, ``-``, ``E``.)

Every builder of these lines hands the ``--spec`` object to the model as it is (``HybridModel(
hybrid_stack_spec=...)`` / ``MambaModel(mamba_stack_spec=...)``), so ``ring_hybrid_stack_spec`` is a stack
``ModuleSpec`` on every line (also callable as ``ring_hybrid_stack_spec(config[, vp_stage])``, returning
itself, for providers that call a spec). Its submodules are Megatron's own hybrid stack spec
(``hybrid_stack_spec``; ``mamba_stack_spec`` before the hybrid package existed) with:

* only the core attention of the attention layers (``*``, MLA ``+``, and the attention layers of the
  multi-token-prediction block, which Megatron builds from the same submodules) swapped for
  ``RingDotProductAttention``; Mamba (``M``), GDN (``G``), MLP (``-``) and MoE (``E``) layers are Megatron's,
  and at CP > 1 run Megatron's own context parallelism (an all-to-all over heads that first undoes the
  zigzag order, the order in which the ring holds tokens: the same split for every layer);
* TransformerEngine modules where TransformerEngine is installed; where it is not, the local equivalent of
  each (``ColumnParallelLinear`` / ``RowParallelLinear``, a fused norm+linear split into Megatron's local
  norm in the layer's norm slot + the linear, local MoE experts, and the stack's final norm, which the stack
  class hard-codes as ``TENorm``, built as Megatron's local norm);
* DeepSeek sparse attention (``D``) refused by name when such a layer is built: its indexer selects keys
  per query, which a ring of contiguous K/V blocks cannot serve exactly.

The stack module is :class:`RingHybridStack`, which is never an instance itself: built with the stack's
arguments it builds Megatron's own stack class and prints one line (rank 0) naming the layers that got the
ring. :func:`ring_hybrid_spec` converts any hybrid stack spec the same way (``ring_spec`` calls it for hybrid
stack specs, e.g. Megatron-Bridge's ``HybridModelProvider.hybrid_stack_spec``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.megatron import compat
from megatron_ring.megatron.config import ContextParallelConfigError
from megatron_ring.megatron.data import token_order
from megatron_ring.megatron.spec.layers import with_ring_attention
from megatron_ring.megatron.spec.stock import check_stock_layout, ring_core

__all__ = ["ring_hybrid_stack_spec", "reference_hybrid_stack_spec", "ring_hybrid_spec", "RingHybridStack", "RingHybridStackSpec",
           "RefusedHybridLayer", "megatron_hybrid_stack_spec", "hybrid_layers_with_ring"]

#: layer symbols of Megatron's hybrid pattern whose core attention the ring replaces
RING_SYMBOLS = {"*": "attention", "+": "multi-latent attention"}
#: layer symbols refused by name (field of the stack submodules -> why)
REFUSED = {"dsa_layer": ("D", "DeepSeek sparse attention: its indexer picks the keys of each query, which a ring of "
                              "contiguous K/V blocks cannot serve exactly; use '*' (or '+', MLA) layers with the ring, "
                              "or Megatron's own spec without megatron_ring for DSA")}
#: where a fused norm+linear's norm goes when the two are split: the child slot -> its layer's norm slot
_NORM_SLOT = {"self_attention": "input_layernorm", "mlp": "pre_mlp_layernorm", "mixer": "norm"}


class RefusedHybridLayer:
    """Module of a hybrid layer the ring cannot serve: building it raises, naming the layer symbol."""

    def __new__(cls, *args: Any, symbol: str = "?", why: str = "", **kwargs: Any) -> Any:
        raise NotImplementedError(f"ring_hybrid_stack_spec: hybrid layer '{symbol}' ({why})")


# --------------------------------------------------------------------------------------------------
# TransformerEngine -> local equivalents
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _local_map() -> dict[int, Any]:
    """id(TransformerEngine module class) -> Megatron's local module doing the same job."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    norm = compat.local_norm_class()
    out: dict[int, Any] = {}
    for name, local in (("TEColumnParallelLinear", ColumnParallelLinear), ("TELayerNormColumnParallelLinear",
                        ColumnParallelLinear), ("TERowParallelLinear", RowParallelLinear), ("TELinear",
                        ColumnParallelLinear), ("TENorm", norm), ("TEDotProductAttention", DotProductAttention)):
        if hasattr(te, name):
            out[id(getattr(te, name))] = local
    return out


def _fused_norm_linear() -> Any:
    from megatron.core.extensions import transformer_engine as te

    return getattr(te, "TELayerNormColumnParallelLinear", None)


def _to_local(node: Any, memo: dict[int, Any], fused: list[bool]) -> Any:
    """A copy of ``node`` with TransformerEngine modules replaced by local ones; ``fused[0]`` is set when a
    fused norm+linear was split (its caller then fills the layer's norm slot)."""
    if id(node) in memo:
        return memo[id(node)]
    mapping = _local_map()
    if id(node) in mapping:
        if node is _fused_norm_linear():
            fused[0] = True
        return mapping[id(node)]
    if isinstance(node, list):
        new: Any = [_to_local(x, memo, fused) for x in node]
    elif isinstance(node, tuple) and not hasattr(node, "_fields"):
        new = tuple(_to_local(x, memo, fused) for x in node)
    elif isinstance(node, dict):
        new = {k: _to_local(v, memo, fused) for k, v in node.items()}
    elif isinstance(node, ModuleSpec):
        new = copy.copy(node)
        new.module = _to_local(node.module, memo, fused)
        new.submodules = _to_local(node.submodules, memo, fused)
        new.params = _to_local(node.params, memo, fused)
    elif isinstance(node, functools.partial):
        new = functools.partial(node.func, *_to_local(node.args, memo, fused), **_to_local(node.keywords, memo, fused))
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        new = copy.copy(node)
        for f in dataclasses.fields(node):
            child_fused = [False]
            setattr(new, f.name, _to_local(getattr(node, f.name), memo, child_fused))
            slot = _NORM_SLOT.get(f.name)
            if child_fused[0] and slot is not None and hasattr(new, slot):
                setattr(new, slot, compat.local_norm_class())  # the norm the fused linear carried
            elif child_fused[0]:
                fused[0] = True  # the layer holding the norm slot is further up
    else:
        return node
    memo[id(node)] = new
    return new


def _local_equivalent(spec: ModuleSpec) -> ModuleSpec:
    out = _to_local(spec, {}, [False])
    moe = getattr(out.submodules, "moe_layer", None)
    if isinstance(moe, ModuleSpec) and moe.submodules is not None and hasattr(moe.submodules, "mlp"):
        moe.submodules = copy.copy(moe.submodules)
        moe.submodules.mlp = compat.local_moe_spec()  # TransformerEngine's grouped experts -> local experts
    return out


def megatron_hybrid_stack_spec() -> ModuleSpec:
    """Megatron's own hybrid stack spec with TransformerEngine modules where it is installed, the local
    equivalent where not (core attention stays Megatron's: the control without the ring)."""
    spec = compat.megatron_hybrid_stack_spec()
    return spec if compat.has_transformer_engine() else _local_equivalent(spec)


# --------------------------------------------------------------------------------------------------
# the ring swap
# --------------------------------------------------------------------------------------------------
def ring_hybrid_spec(spec: Any, core_attention: Any = None) -> ModuleSpec:
    """A copy of a hybrid stack spec (``HybridStack`` / ``MambaStack`` ``ModuleSpec``) with ring core
    attention in its attention layers (and MTP block), refused layers (``D``) replaced by a refusal, and
    :class:`RingHybridStack` as its module. ``core_attention``: default the stock-split ring."""
    if isinstance(spec, RingHybridStackSpec):
        spec._resolve()
        if spec._ring:
            return spec
        spec = ModuleSpec(module=spec._stack, submodules=spec._submodules, params=dict(spec._params))
    if not is_hybrid_stack_spec(spec):
        raise TypeError(f"ring_hybrid_spec: {type(spec).__name__} is not a hybrid stack ModuleSpec "
                        "(HybridStack / MambaStack); use ring_spec(...) for layer or block specs")
    sub = copy.copy(spec.submodules)
    for field, (symbol, why) in REFUSED.items():
        if hasattr(sub, field):
            setattr(sub, field, ModuleSpec(module=RefusedHybridLayer, params={"symbol": symbol, "why": why}))
    swapped = with_ring_attention(ModuleSpec(module=spec.module, params=dict(spec.params), submodules=sub),
                                  core_attention if core_attention is not None else ring_core())
    return RingHybridStackSpec(stack=spec.module, submodules=swapped.submodules, params=swapped.params)


def is_hybrid_stack_spec(spec: Any) -> bool:
    """Whether ``spec`` is a ``ModuleSpec`` of Megatron's hybrid stack (or already a ring one)."""
    if isinstance(spec, RingHybridStackSpec):
        return True
    stack = compat.hybrid_stack_class()
    return isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and stack is not None \
        and issubclass(spec.module, stack)


def hybrid_layers_with_ring(layer_types: list[str], offset: int = 0) -> str:
    """``"layers 2, 4 (*) of 4"``: where the ring runs in a stack of these layer symbols."""
    ring = [f"{offset + i + 1}" for i, t in enumerate(layer_types) if t in RING_SYMBOLS]
    kinds = "".join(sorted({t for t in layer_types if t in RING_SYMBOLS}))
    if not ring:
        return f"no attention layer of {len(layer_types)} (pattern {''.join(layer_types)})"
    return f"layers {', '.join(ring)} ({kinds}) of {len(layer_types)} (pattern {''.join(layer_types)})"


class RingHybridStack:
    """The module of :class:`RingHybridStackSpec`: never an instance itself. Built with the stack's
    arguments, it checks the layers, builds Megatron's own stack class with the ring submodules and
    announces (rank 0) which layers got the ring."""

    def __new__(cls, config: Any = None, submodules: Any = None, *args: Any, _stack: Any = None,
                _ring: bool = True, **kwargs: Any) -> Any:
        if config is None or submodules is None or _stack is None:
            raise TypeError("RingHybridStack is built by HybridModel / MambaModel from ring_hybrid_stack_spec")
        if _ring:
            check_stock_layout()
        types = kwargs.get("layer_type_list")
        for field, (symbol, why) in REFUSED.items():
            if types is not None and symbol in types:
                where = [i + 1 + int(kwargs.get("pp_layer_offset", 0) or 0) for i, t in enumerate(types) if t == symbol]
                raise NotImplementedError(f"ring_hybrid_stack_spec: hybrid layer '{symbol}' at layer(s) {where} "
                                          f"({why})")
        if _ring and types is not None:  # Megatron-LM's stream-wide THD split: M/G, RoPE cannot follow it
            token_order.check_sequence_split(int(getattr(config, "context_parallel_size", 1) or 1), types)
        local_norm = not compat.has_transformer_engine()
        want_norm = kwargs.get("post_layer_norm", True) and kwargs.get("post_process", True)
        if local_norm:  # the stack hard-codes TENorm as its final norm: build Megatron's local norm instead
            kwargs["post_layer_norm"] = False
        stack = _stack(config, submodules, *args, **kwargs)
        if local_norm and want_norm:
            stack.final_norm = compat.local_norm_class()(config=config, hidden_size=config.hidden_size,
                                                         eps=config.layernorm_epsilon)
            stack.post_layer_norm = True
        _check_qk_clip(stack, config, int(kwargs.get("pp_layer_offset", 0) or 0))
        if _ring:
            _announce_stack(stack, config, kwargs)
        return stack


def _check_qk_clip(stack: Any, config: Any, offset: int) -> None:
    """QK-clip on a hybrid stack: refused by name where this Megatron line's ``clip_qk`` cannot walk the stack
    (it reads ``self_attention`` on every decoder layer, which Mamba layers lack: AttributeError after the first
    optimizer step). Stacks whose layers all have ``self_attention`` (attention, MLP, MoE, GDN: ``*-*-``) pass."""
    flag = compat.qk_clip_requested(config)
    if flag is None:
        return
    bare = [(offset + i + 1, t) for i, (t, layer) in enumerate(zip(getattr(stack, "layer_type_list", None)
                                                                    or ["?"] * len(stack.layers), stack.layers))
            if not hasattr(layer, "self_attention")]
    if bare and not compat.qk_clip_passes_layers_without_attention():
        where = ", ".join(f"{n} ('{t}')" for n, t in bare)
        raise ContextParallelConfigError(
            flag, f"this megatron-core's QK-clip (megatron.core.optimizer.qk_clip.clip_qk) reads self_attention on "
                  f"every decoder layer, and hybrid layer(s) {where} of --hybrid-layer-pattern have none (Mamba): it "
                  f"would fail after the first optimizer step. Use a pattern without Mamba layers (e.g. '*-*-') or "
                  f"drop {flag}")


def _announce_stack(stack: Any, config: Any, kwargs: dict) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    types = list(getattr(stack, "layer_type_list", []) or [])
    offset = int(kwargs.get("pp_layer_offset", 0) or 0)
    where = "multi-token prediction" if kwargs.get("is_mtp_layer") else "--spec ring_hybrid_stack_spec"
    cp = getattr(config, "context_parallel_size", 1)
    others = sorted({t for t in types if t not in RING_SYMBOLS})
    print(f"> megatron_ring ({where}): ring attention in {hybrid_layers_with_ring(types, offset)}; "
          f"{', '.join(others) or 'no other'} layers are Megatron's (CP={cp} through Megatron's own all-to-all "
          f"for M/G, tokens in the zigzag order of the ring); "
          f"{'TransformerEngine' if compat.has_transformer_engine() else 'local'} modules", flush=True)


class RingHybridStackSpec(ModuleSpec):
    """A hybrid stack ``ModuleSpec`` whose module is :class:`RingHybridStack` (building Megatron's own stack
    class ``stack``). Its ``submodules`` are resolved on first use (``ring_hybrid_stack_spec`` is defined
    at import without importing Megatron's hybrid specs). Callable as ``spec(config[, vp_stage])``: returns
    itself, for model providers that call a spec."""

    def __init__(self, stack: Any = None, submodules: Any = None, params: dict | None = None, ring: bool = True) -> None:
        self._stack = stack
        self._submodules = submodules
        self._ring = ring  # False: Megatron's own attention (the reference / control), same stack and modules
        super().__init__(module=RingHybridStack, params=dict(params or {}), submodules=submodules)

    def _resolve(self) -> None:
        if self._submodules is None:
            resolved: Any = ring_hybrid_spec(megatron_hybrid_stack_spec()) if self._ring else None
            if resolved is None:
                plain = megatron_hybrid_stack_spec()
                self._stack, self._submodules = plain.module, plain.submodules
            else:
                self._stack, self._submodules = resolved._stack, resolved._submodules

    @property  # type: ignore[override]
    def submodules(self) -> Any:
        self._resolve()
        return self._submodules

    @submodules.setter
    def submodules(self, value: Any) -> None:
        self._submodules = value

    @property  # type: ignore[override]
    def params(self) -> dict:
        self._resolve()
        return {**self._params, "_stack": self._stack, "_ring": self._ring}

    @params.setter
    def params(self, value: dict) -> None:
        self._params = {k: v for k, v in (value or {}).items() if k not in ("_stack", "_ring")}

    def __call__(self, config: Any = None, vp_stage: Any = None) -> "RingHybridStackSpec":
        self._resolve()
        return self

    def __repr__(self) -> str:
        state = "resolved" if self._submodules is not None else "resolved at first use"
        return f"RingHybridStackSpec({getattr(self._stack, '__name__', 'stack')}, {state})"


#: ``--spec megatron_ring.megatron.spec ring_hybrid_stack_spec`` on ``pretrain_hybrid.py`` / ``pretrain_mamba.py``
ring_hybrid_stack_spec = RingHybridStackSpec()

#: the same stack with Megatron's own core attention (no ring): the CP=1 reference and the control that
#: Megatron refuses at CP > 1 without TransformerEngine (``--spec megatron_ring.megatron.spec.hybrid
#: reference_hybrid_stack_spec``; on CPU where TransformerEngine's default spec cannot be built)
reference_hybrid_stack_spec = RingHybridStackSpec(ring=False)
