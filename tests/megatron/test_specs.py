"""Ring attention in any Megatron spec (version-agnostic: runs on every supported megatron-core).

``with_ring_attention`` must change exactly one thing per self-attention — its core attention — in the
local GPT layer spec, the TransformerEngine layer spec (built by Megatron's own function; without TE
installed its TE classes are megatron-core's placeholders, so the tree is checked structurally), the MoE
decoder-block spec and the multi-token-prediction block spec. ``get_gpt_layer_ring_spec`` must equal the
local spec with only that change, on every release (the 0.19 positional-argument trap: ``qk_l2_norm``).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch.distributed as dist

from megatron.core.models.gpt import gpt_layer_specs as S
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.megatron import RingDotProductAttention, get_gpt_layer_ring_spec, with_ring_attention
from megatron_ring.megatron import compat


def _leaves(node, path="spec"):
    """Every (path, leaf) of a spec tree: modules/callables named by specs and submodule dataclasses."""
    if isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
            yield from _leaves(x, f"{path}[{i}]")
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(node, ModuleSpec):
        yield f"{path}.module", node.module
        yield from _leaves(node.params, f"{path}.params")
        yield from _leaves(node.submodules, f"{path}.submodules")
    elif isinstance(node, functools.partial):  # 0.19: partial(MLP.as_mlp_submodule, submodules=...)
        yield f"{path}.func", node.func
        yield from _leaves(list(node.args), f"{path}.args")
        yield from _leaves(node.keywords, f"{path}.keywords")
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from _leaves(getattr(node, f.name), f"{path}.{f.name}")
    else:
        yield path, node


def _assert_only_core_attention_changed(before, after, expect_swaps):
    a, b = dict(_leaves(before)), dict(_leaves(after))
    assert a.keys() == b.keys(), "the tree's shape changed"
    changed = sorted(k for k in a if a[k] is not b[k] and a[k] != b[k])  # == : bound methods are rebuilt
    assert changed and all(k.endswith("self_attention.submodules.core_attention") for k in changed), changed
    assert len(changed) == expect_swaps, changed
    assert all(b[k] is RingDotProductAttention for k in changed)
    # the input spec is untouched
    assert all(v is not RingDotProductAttention for v in a.values())


@pytest.fixture
def mpu(tmp_path):
    """A 1-process gloo world with Megatron's groups (block specs ask the pipeline rank)."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        yield ps
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _mlp_submodules(mlp):
    """0.16: ModuleSpec(MLP, submodules=...); 0.19: partial(MLP.as_mlp_submodule, submodules=...)."""
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def _mlp_name(mlp):
    if isinstance(mlp, functools.partial):
        owner = getattr(mlp.func, "__self__", mlp.func)
        return getattr(owner, "__name__", type(owner).__name__)
    return mlp.module.__name__


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw)


def test_ring_spec_is_local_spec_with_only_core_attention_changed():
    for kw in (dict(normalization="RMSNorm"), dict(), dict(qk_layernorm=True, normalization="LayerNorm")):
        local = compat.gpt_layer_local_spec(**kw)
        ring = get_gpt_layer_ring_spec(**kw)
        _assert_only_core_attention_changed(local, ring, 1)
        # never an L2Norm slipped in through a shifted positional argument (0.19's qk_l2_norm)
        assert "L2Norm" not in {getattr(v, "__name__", "") for _, v in _leaves(ring)}
    mla_local = compat.gpt_layer_local_spec(multi_latent_attention=True)
    _assert_only_core_attention_changed(mla_local, get_gpt_layer_ring_spec(multi_latent_attention=True), 1)


def test_keyword_a_release_lacks_is_refused_unless_default():
    names = compat.accepted_kwargs(S.get_gpt_layer_local_spec,
                                   *[f for f in (getattr(S, "get_gpt_layer_local_submodules", None),) if f])
    if "moe_use_legacy_grouped_gemm" in names:
        pytest.skip("this megatron-core still has moe_use_legacy_grouped_gemm")
    get_gpt_layer_ring_spec(moe_use_legacy_grouped_gemm=False)  # default: harmless, dropped
    with pytest.raises(TypeError, match="moe_use_legacy_grouped_gemm"):
        get_gpt_layer_ring_spec(moe_use_legacy_grouped_gemm=True)


def test_with_ring_attention_local_spec():
    local = compat.gpt_layer_local_spec(normalization="RMSNorm")
    _assert_only_core_attention_changed(local, with_ring_attention(local), 1)


def _te_layer_spec(monkeypatch):
    """Megatron's own ``get_gpt_layer_with_transformer_engine_spec`` without TE installed.

    megatron-core still defines its TE classes then (as placeholders); only the import guard in
    gpt_layer_specs and TE's version probe are stood in, so the tree is the one Megatron builds.
    """
    try:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.extensions import transformer_engine_spec_provider as te_prov
    except Exception as e:  # pragma: no cover - depends on the megatron-core release
        pytest.skip(f"megatron-core's TE extension does not import without TE here: {e}")
    if not getattr(S, "HAVE_TE", False):
        monkeypatch.setattr(te_prov, "is_te_min_version", lambda *a, **k: True, raising=False)
        monkeypatch.setattr(S, "TESpecProvider", te_prov.TESpecProvider, raising=False)
        monkeypatch.setattr(S, "TENorm", te_ext.TENorm, raising=False)
        if hasattr(te_ext, "TEFusedMLP"):
            monkeypatch.setattr(S, "TEFusedMLP", te_ext.TEFusedMLP, raising=False)
    return S.get_gpt_layer_with_transformer_engine_spec(), te_ext


def test_with_ring_attention_te_spec_structurally(monkeypatch):
    te, te_ext = _te_layer_spec(monkeypatch)
    ring = with_ring_attention(te)
    _assert_only_core_attention_changed(te, ring, 1)
    attn = ring.submodules.self_attention.submodules
    assert attn.linear_qkv is te_ext.TELayerNormColumnParallelLinear  # TE's fused norm+linear kept
    assert attn.linear_proj is te_ext.TERowParallelLinear
    assert _mlp_submodules(ring.submodules.mlp).linear_fc1 is te_ext.TELayerNormColumnParallelLinear
    assert te.submodules.self_attention.submodules.core_attention is te_ext.TEDotProductAttention


def test_with_ring_attention_moe_block_and_mtp_block(mpu):
    cfg = _config(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0], mtp_num_layers=1)
    block = S.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    assert [_mlp_name(l.submodules.mlp) for l in block.layer_specs] == ["MoELayer", "MLP"]
    _assert_only_core_attention_changed(block, with_ring_attention(block), 2)
    mtp = S.get_gpt_mtp_block_spec(cfg, block.layer_specs[-1], use_transformer_engine=False)
    ring_mtp = with_ring_attention(mtp)
    _assert_only_core_attention_changed(mtp, ring_mtp, 1)
    mtp_sub = ring_mtp.layer_specs[0].submodules  # 0.16: transformer_layer; 0.19: mtp_model_layer
    layer = getattr(mtp_sub, "transformer_layer", None) or getattr(mtp_sub, "mtp_model_layer")
    assert layer.submodules.self_attention.submodules.core_attention is RingDotProductAttention
    # a list of layer specs (Megatron's get_gpt_decoder_layer_specs) works too
    _assert_only_core_attention_changed(block.layer_specs, with_ring_attention(block.layer_specs), 2)


def test_with_ring_attention_refuses_what_it_cannot_do():
    from megatron.core.transformer.mlp import MLP

    with pytest.raises(ValueError, match="no self-attention"):
        with_ring_attention(ModuleSpec(module=MLP))
    mla = S.get_gpt_layer_local_spec(multi_latent_attention=True)  # MLA is supported: only core attention changes
    _assert_only_core_attention_changed(mla, with_ring_attention(mla), 1)
