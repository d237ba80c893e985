"""``ring_layer_spec`` as a layer ``ModuleSpec``: the way Megatron-LM core_v0.16.1's ``gpt_builders`` uses ``--spec``.

core_v0.16.1 passes the ``--spec`` object to ``GPTModel(transformer_layer_spec=...)`` as it is. Here the same
is done in one process (gloo, CPU, CP=1) with :data:`ring_layer_module_spec`, and the model is compared with
the one Megatron builds from its own spec for the config (the local layer spec; for MoE its decoder block
spec): the same module tree except the core attention's class, the same parameters (same initialisation
order), and the same logits and gradients (fp32, within the model-level rule of tests/helpers/numerics.py: logits
``rel_fwd max |logits|``, each gradient tensor ``rel_grad max |g_ref|``). Runs on every supported megatron-core: which object
the name ``ring_layer_spec`` is depends on whether ``GPTModelBuilder`` exists, and that choice is checked
against an import of ``megatron.training.models.gpt``.
"""
from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt import gpt_layer_specs as S
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.helpers.numerics import Checks, add_model_grads, max_err, model_bounds

from megatron_ring.megatron import (RingDotProductAttention, compat)
from megatron_ring_lab.cpu import megatron_cpu
from megatron_ring.megatron import spec as ring_spec_module
from megatron_ring.megatron.spec import (RingLayerSpec, RingTransformerLayer, describe_core_attention,
                                         ring_layer_module_spec, ring_layer_spec, ring_layer_spec_provider)

VOCAB, SEQ, BATCH = 64, 16, 2
#: the model-level rule's sizes (``_cfg``: 2 layers, hidden 32, FFN 64; one batch of BATCH x SEQ tokens)
SIZES = dict(seq=SEQ, hidden=32, layers=2, ffn=64, tokens=BATCH * SEQ)


def _builder_importable() -> bool:
    try:
        from megatron.training.models.gpt import GPTModelBuilder  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture
def mpu(tmp_path):
    """A 1-process gloo world with Megatron's groups, inside the CPU opt-in."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with megatron_cpu():
            ps.initialize_model_parallel()
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            try:
                yield ps
            finally:
                ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                use_cpu_initialization=True, transformer_impl="local", normalization="RMSNorm",
                gated_linear_unit=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
                context_parallel_size=1)
    base.update(kw)
    return TransformerConfig(**base)


def test_the_name_follows_the_builder():
    """Where GPTModelBuilder exists (main / r0.19: it calls the spec) the name is the provider function,
    elsewhere (core_v0.16 gpt_builders, megatron-core alone: the spec is used as it is) the ModuleSpec."""
    if _builder_importable():
        assert ring_layer_spec is ring_layer_spec_provider and not isinstance(ring_layer_spec, ModuleSpec)
        assert list(inspect.signature(ring_layer_spec).parameters) == ["config", "vp_stage"]
    else:
        assert ring_layer_spec is ring_layer_module_spec
    assert isinstance(ring_layer_module_spec, RingLayerSpec) and ring_layer_module_spec.module is RingTransformerLayer
    # both are callable as ring_layer_spec(config, vp_stage=None) with the same result
    a, b = ring_layer_module_spec(_cfg(context_parallel_size=2)), ring_layer_spec_provider(_cfg(context_parallel_size=2))
    assert isinstance(a, ModuleSpec) and not isinstance(a, RingLayerSpec)
    assert repr(a) == repr(b) and describe_core_attention(a) == "RingDotProductAttention x1"


def _build(spec, cfg):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _tree(model):
    """(name, class) of every module; a core attention's own children (Megatron's softmax, dropout) left out."""
    return [(name, type(m).__name__) for name, m in model.named_modules() if ".core_attention." not in name]


def _run(model):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    logits = model(tokens, pos, mask)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(ours, megatrons, n_swaps, forward=True):
    a, b = _tree(ours), _tree(megatrons)
    assert [n for n, _ in a] == [n for n, _ in b]
    diff = [(n, x, y) for (n, x), (_, y) in zip(a, b) if x != y]
    assert len(diff) == n_swaps and all(n.endswith("core_attention") and (x, y) == (
        "RingDotProductAttention", "DotProductAttention") for n, x, y in diff), diff
    sa, sb = ours.state_dict(), megatrons.state_dict()
    keys = [k for k in sb if not k.endswith("_extra_state")]
    assert [k for k in sa if not k.endswith("_extra_state")] == keys
    assert all(torch.equal(sa[k], sb[k]) for k in keys if isinstance(sb[k], torch.Tensor))  # same init order
    if not forward:
        return
    (la, ga), (lb, gb) = _run(ours), _run(megatrons)
    c = Checks("ring_layer_module_spec vs Megatron's spec")
    c.add("logits", max_err(la, lb), model_bounds(**SIZES)["rel_fwd"] * lb.abs().max().item())
    add_model_grads(c, ga, gb, **SIZES)
    c.check(min_rows=2)


def test_dense_model_from_the_module_spec_is_megatrons_local_model(mpu):
    cfg = _cfg()
    ours = _build(ring_layer_module_spec, cfg)
    megatrons = _build(compat.gpt_layer_local_spec(normalization="RMSNorm"), cfg)
    assert len(ours.decoder.layers) == 2
    _compare(ours, megatrons, n_swaps=2)


def test_moe_layers_are_picked_per_layer_from_megatrons_block_spec(mpu, monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the router moves its weight there
    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0], moe_ffn_hidden_size=32,
               moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    block = S.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    ours = _build(ring_layer_module_spec, cfg)
    megatrons = _build(block, cfg)
    assert [type(layer.mlp).__name__ for layer in ours.decoder.layers] == ["MoELayer", "MLP"]
    # megatron-core 0.16.1's router reads te_general_gemm, undefined without TransformerEngine (NameError):
    # its MoE layers cannot run forward on CPU there, so that release compares the modules and parameters only
    _compare(ours, megatrons, n_swaps=2, forward=hasattr(moe_utils, "te_general_gemm"))


def test_a_block_whose_final_norm_would_differ_is_refused(mpu, monkeypatch):
    from megatron.core.transformer import transformer_block as tb

    class OtherNorm(torch.nn.Module):
        pass

    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0], moe_ffn_hidden_size=32)
    monkeypatch.setattr(tb, "LayerNormImpl", OtherNorm)
    with pytest.raises(NotImplementedError, match="OtherNorm"):
        _build(ring_layer_module_spec, cfg)


def test_refusals_by_name(monkeypatch):
    with pytest.raises(NotImplementedError, match="heterogeneous"):
        RingTransformerLayer(config=SimpleNamespace(heterogeneous_block_specs=True), layer_number=1)
    with pytest.raises(TypeError, match="no submodules"):
        RingTransformerLayer(config=_cfg(), submodules=object(), layer_number=1)
    # a builder that builds the MTP block from Megatron's own specs before the layers: refused unless wrapped
    fake = SimpleNamespace(get_gpt_mtp_block_spec=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "gpt_builders", fake)
    if "megatron.training.models.gpt" in sys.modules:  # keep this test independent of other tests' wrapping
        monkeypatch.delitem(sys.modules, "megatron.training.models.gpt")
    with pytest.raises(NotImplementedError, match="--mtp-num-layers 1"):
        ring_spec_module.mtp.refuse_unswapped_mtp(_cfg(mtp_num_layers=1))
    ring_spec_module.mtp.refuse_unswapped_mtp(_cfg())  # no MTP: nothing to refuse
    ring_spec_module.install_mtp_ring_attention()
    assert getattr(fake.get_gpt_mtp_block_spec, "_megatron_ring", False)
    ring_spec_module.mtp.refuse_unswapped_mtp(_cfg(mtp_num_layers=1))  # wrapped: the MTP block gets ring attention


def test_called_with_layer_arguments_it_builds_like_any_module_spec(mpu):
    layer = ring_layer_module_spec(_cfg(), layer_number=1)
    assert type(layer).__name__ == "TransformerLayer"
    assert isinstance(layer.self_attention.core_attention, RingDotProductAttention)
