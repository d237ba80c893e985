"""Ring attention in Megatron layer specs.

* :func:`get_gpt_layer_ring_spec`: Megatron's local GPT layer spec with ring attention as core attention
  (same arguments as ``get_gpt_layer_local_spec``, keywords passed through :mod:`megatron_ring.megatron.compat`).
* :func:`with_ring_attention`: ANY layer or block spec (local, TransformerEngine, MoE decoder block,
  multi-token-prediction block, heterogeneous, user specs) with only its self-attention's core attention
  replaced; linears, norms, MLP/MoE and everything else stay exactly as given.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.megatron import compat
from megatron_ring.megatron.attention.module import RingDotProductAttention

__all__ = ["get_gpt_layer_ring_spec", "with_ring_attention"]


def get_gpt_layer_ring_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    **kwargs: Any,
) -> ModuleSpec:
    """Same arguments as ``get_gpt_layer_local_spec``; the only change is the core attention.

    Swap one line in a model builder::

        spec = get_gpt_layer_ring_spec(normalization="RMSNorm")   # was get_gpt_layer_local_spec(...)

    Arguments are passed by keyword on every supported megatron-core; one a release lacks
    (``moe_use_legacy_grouped_gemm`` after 0.16) is accepted at its default and refused otherwise.
    ``multi_latent_attention=True`` builds Megatron's ``MLASelfAttention`` layer (V's head dim differs
    from Q/K's; the ring packs K and V into one wire buffer all the same) with ring core attention.
    """
    spec = compat.gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        multi_latent_attention=bool(multi_latent_attention), fp8=fp8,
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        normalization=normalization, qk_l2_norm=qk_l2_norm, **kwargs)
    spec.submodules.self_attention.submodules.core_attention = RingDotProductAttention
    return spec


def _is_self_attention(spec: ModuleSpec) -> bool:
    from megatron.core.transformer.attention import Attention, CrossAttention

    mod = spec.module  # SelfAttention, MLASelfAttention, or a user's subclass; never cross attention
    return isinstance(mod, type) and issubclass(mod, Attention) and not issubclass(mod, CrossAttention) \
        and hasattr(spec.submodules, "core_attention")


def with_ring_attention(spec: Any, core_attention: Any = RingDotProductAttention) -> Any:
    """A copy of ``spec`` (``ModuleSpec``, ``TransformerBlockSubmodules``, MTP block spec, or a list of
    them) in which every self-attention's ``core_attention`` is ``core_attention`` (ring attention).

    Walks the whole spec tree: ``ModuleSpec.submodules`` dataclasses, ``layer_specs`` lists, nested
    specs (MTP layers hold a transformer-layer spec). Everything that is not a self-attention core
    attention is kept as is — TransformerEngine linears/norms, MoE experts, cross attention. The input
    is not modified. Multi-latent attention (MLA) layers get ring attention too (V's head dim may differ).
    ``core_attention`` is a class or a ``ModuleSpec`` (e.g. with ``params``).

    Raises ``ValueError`` when the tree holds no self-attention (nothing would change: never silent).
    """
    count = [0]
    out = _swap(spec, core_attention, count, {})
    if count[0] == 0:
        raise ValueError(f"with_ring_attention: no self-attention with a core_attention found in {type(spec).__name__}"
                         " (nothing to replace)")
    return out


def _swap(node: Any, core: Any, count: list[int], memo: dict[int, Any]) -> Any:
    """A copy of ``node`` with core attention swapped; copies only containers (specs, submodule
    dataclasses, lists, tuples, dicts, partials), never the modules or callables they name."""
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, list):
        new: Any = [_swap(x, core, count, memo) for x in node]
    elif isinstance(node, tuple) and not hasattr(node, "_fields"):
        new = tuple(_swap(x, core, count, memo) for x in node)
    elif isinstance(node, dict):
        new = {k: _swap(v, core, count, memo) for k, v in node.items()}
    elif isinstance(node, ModuleSpec):
        new = copy.copy(node)
        if _is_self_attention(node):
            new.submodules = copy.copy(node.submodules)
            new.submodules.core_attention = core
            count[0] += 1
        else:
            new.submodules = _swap(node.submodules, core, count, memo)
            new.params = _swap(node.params, core, count, memo)
    elif isinstance(node, functools.partial):  # 0.19 builds MLPs through partial(MLP.as_mlp_submodule, ...)
        args = _swap(node.args, core, count, memo)
        keywords = _swap(node.keywords, core, count, memo)
        new = functools.partial(node.func, *args, **keywords) if (args, keywords) != (node.args, node.keywords) \
            else node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        new = copy.copy(node)
        for f in dataclasses.fields(node):
            setattr(new, f.name, _swap(getattr(node, f.name), core, count, memo))
    else:
        return node
    memo[id(node)] = new
    return new
