"""``ring_hybrid_stack_spec``: what the object is, on every megatron-core line (0.19: ``HybridStack``; 0.16:
``MambaStack``). No processes: the spec tree only (the models are run in test_hybrid_model.py)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.megatron import compat
from megatron_ring.megatron.attention import RingDotProductAttention
from megatron_ring.megatron.spec import ring_hybrid_stack_spec, ring_spec
from megatron_ring.megatron.spec import hybrid as H



def _hybrid_spec_importable() -> bool:
    try:
        return compat.hybrid_stack_class() is not None and compat.megatron_hybrid_stack_spec() is not None
    except ImportError:  # megatron-core 0.16.1's Mamba mixer imports triton at module level
        return False


pytestmark = pytest.mark.skipif(not _hybrid_spec_importable(),
                                reason="Megatron's hybrid stack spec cannot be imported here (no hybrid stack, or "
                                       "megatron-core 0.16.1's Mamba mixer without triton)")


def _walk(node, seen=None):
    """Every object reachable in a spec tree (specs, submodule dataclasses, partials, lists)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node
    children = []
    if isinstance(node, ModuleSpec):
        children = [node.module, node.submodules, *node.params.values()]
    elif isinstance(node, functools.partial):
        children = [*node.args, *node.keywords.values()]
    elif isinstance(node, (list, tuple)):
        children = list(node)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        children = [getattr(node, f.name) for f in dataclasses.fields(node)]
    for c in children:
        yield from _walk(c, seen)


def _core(layer):
    return layer.submodules.self_attention.submodules.core_attention


def test_is_a_stack_module_spec_and_callable():
    spec = ring_hybrid_stack_spec
    assert isinstance(spec, ModuleSpec) and spec.module is H.RingHybridStack
    assert spec(object()) is spec and spec(object(), vp_stage=0) is spec  # the provider form returns itself
    assert spec.params["_stack"] is compat.hybrid_stack_class() and spec.params["_ring"] is True


def test_only_attention_cores_swapped_and_dsa_refused():
    sub = ring_hybrid_stack_spec.submodules
    core = _core(sub.attention_layer)
    assert core.module is RingDotProductAttention and core.params == {"batch_split": "megatron"}
    if hasattr(sub, "mla_layer"):
        assert _core(sub.mla_layer).module is RingDotProductAttention
    if hasattr(sub, "dsa_layer"):
        assert sub.dsa_layer.module is H.RefusedHybridLayer and sub.dsa_layer.params["symbol"] == "D"
        with pytest.raises(NotImplementedError, match="hybrid layer 'D'.*DeepSeek sparse attention"):
            H.RefusedHybridLayer(config=None, **sub.dsa_layer.params)
    megatron = compat.megatron_hybrid_stack_spec().submodules
    assert sub.mamba_layer.submodules.mixer.module is megatron.mamba_layer.submodules.mixer.module
    if hasattr(sub, "gdn_layer"):
        assert sub.gdn_layer.submodules.self_attention.module is megatron.gdn_layer.submodules.self_attention.module
    mtp = getattr(sub, "mtp_block_spec", None)
    assert mtp is None or mtp is not megatron.mtp_block_spec  # the MTP block's attention: built from `sub`
    rings = [n for n in _walk(sub) if n is RingDotProductAttention]
    assert rings, "no ring core attention in the tree"


@pytest.mark.skipif(compat.has_transformer_engine(), reason="the local equivalents are used without TransformerEngine")
def test_local_equivalents_without_transformer_engine():
    from megatron.core.extensions import transformer_engine as te

    te_objects = {id(getattr(te, n)) for n in dir(te) if n.startswith("TE") and getattr(te, n) is not None}
    for spec in (ring_hybrid_stack_spec, H.reference_hybrid_stack_spec):
        leftovers = [n for n in _walk(spec.submodules) if id(n) in te_objects]
        assert not leftovers, leftovers
    sub = ring_hybrid_stack_spec.submodules
    norm = compat.local_norm_class()
    assert sub.mamba_layer.submodules.norm is norm  # the norm the fused TE in_proj carried
    assert sub.attention_layer.submodules.input_layernorm is norm
    assert sub.mlp_layer.submodules.pre_mlp_layernorm is norm
    if hasattr(sub, "gdn_layer"):
        assert sub.gdn_layer.submodules.input_layernorm is norm
    assert _core(H.reference_hybrid_stack_spec.submodules.attention_layer).__name__ == "DotProductAttention"


def test_ring_spec_converts_hybrid_stack_specs():
    out = ring_spec(compat.megatron_hybrid_stack_spec())
    assert isinstance(out, H.RingHybridStackSpec) and _core(out.submodules.attention_layer).module is RingDotProductAttention
    assert ring_spec(ring_hybrid_stack_spec) is ring_hybrid_stack_spec
    provider = ring_spec(lambda config: compat.megatron_hybrid_stack_spec())  # Bridge's callable form
    assert isinstance(provider(object()), H.RingHybridStackSpec)
    with pytest.raises(TypeError, match="not a hybrid stack"):
        H.ring_hybrid_spec(ModuleSpec(module=dict))


def test_startup_line_names_the_ring_layers():
    assert H.hybrid_layers_with_ring(list("M*M-")) == "layers 2 (*) of 4 (pattern M*M-)"
    assert H.hybrid_layers_with_ring(list("*-+-"), offset=4) == "layers 5, 7 (*+) of 4 (pattern *-+-)"
    assert H.hybrid_layers_with_ring(list("MM")).startswith("no attention layer")
