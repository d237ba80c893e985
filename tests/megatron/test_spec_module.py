"""megatron_ring.megatron.spec: ``ring_layer_spec(config, vp_stage)`` and Megatron-Bridge's ``ring_spec``."""
from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ring.megatron import ContextParallelConfigError, RingDotProductAttention
from megatron_ring.megatron import compat
from megatron_ring.megatron.spec import describe_core_attention, ring_layer_spec, ring_spec


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                context_parallel_size=2, transformer_impl="local")
    base.update(kw)
    return TransformerConfig(**base)


def _cores(spec):
    return describe_core_attention(spec)


def test_ring_layer_spec_swaps_only_core_attention():
    dense = ring_layer_spec(_cfg(normalization="RMSNorm"))
    assert isinstance(dense, ModuleSpec) and _cores(dense) == "RingDotProductAttention x1"
    core = dense.submodules.self_attention.submodules.core_attention
    assert core.module is RingDotProductAttention and core.params == {"batch_split": "megatron"}
    plain = compat.gpt_layer_local_spec(normalization="RMSNorm")
    assert repr(dense.submodules.mlp) == repr(plain.submodules.mlp)  # the rest is Megatron's own local spec
    assert repr(dense.submodules.input_layernorm) == repr(plain.submodules.input_layernorm)
    # MoE / MTP block specs go through the same tree walk (tests/megatron/test_specs.py covers it)


def test_ring_spec_takes_a_module_spec_or_a_provider():
    plain = compat.gpt_layer_local_spec()
    assert _cores(plain) == "DotProductAttention x1"
    assert _cores(ring_spec(plain)) == "RingDotProductAttention x1"
    assert _cores(plain) == "DotProductAttention x1"  # the input is not modified

    def provider(config, vp_stage=None):
        return compat.gpt_layer_local_spec()

    wrapped = ring_spec(provider)
    assert callable(wrapped) and not isinstance(wrapped, ModuleSpec)
    assert _cores(wrapped(_cfg(), vp_stage=0)) == "RingDotProductAttention x1"
    assert _cores(ring_spec(lambda config: compat.gpt_layer_local_spec())(_cfg())) == "RingDotProductAttention x1"


@pytest.mark.parametrize("layout", ["striped", "contiguous"])
def test_stock_spec_refuses_layouts_stock_megatron_does_not_split(monkeypatch, layout):
    monkeypatch.setenv("MEGATRON_RING_LAYOUT", layout)
    with pytest.raises(ContextParallelConfigError) as e:
        ring_layer_spec(_cfg())
    assert e.value.flag == "MEGATRON_RING_LAYOUT" and "pretrain_ring_gpt.py" in str(e.value)
    with pytest.raises(ContextParallelConfigError, match="MEGATRON_RING_LAYOUT"):
        ring_spec(compat.gpt_layer_local_spec())


def test_stock_split_packed_batches_need_megatrons_per_document_padding(monkeypatch):
    """THD at CP > 1 from stock Megatron is split per document (TransformerEngine's order): the ring runs in
    that order (tests/megatron/test_token_order.py), and a document length that is not a multiple of 2 CP
    (no such split exists) is refused by name."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.megatron.attention import module as attn

    class Two:
        def size(self):
            return 2

    m = RingDotProductAttention(_cfg(), 1, AttnMaskType.causal, "self", batch_split="megatron",
                                pg_collection=SimpleNamespace(cp=Two(), tp=SimpleNamespace(size=lambda: 1)))
    monkeypatch.setattr(attn.groups, "group_ranks", lambda g: (0, 1))
    from megatron_ring.megatron.data.token_order import TokenOrderError

    params = SimpleNamespace(cp_group=None, local_cp_size=None, cu_seqlens_q=torch.tensor([0, 5, 10]),
                             cu_seqlens_q_padded=torch.tensor([0, 6, 10]))
    with pytest.raises(TokenOrderError, match="multiple of 2 x CP = 4"):
        m(None, None, None, None, packed_seq_params=params)
