"""The glue resolves its settings once per layer and group: ``RingDotProductAttention`` reads the ring config
(``MEGATRON_RING_*`` without a registered ring), the comm type, ``MEGATRON_RING_KV_PIECES`` and QK-clip at its
first call on a group and keeps them; a new group (Megatron's eval-time rebinding of ``pg_collection``, a
per-call ``packed_seq_params.cp_group``) resolves them again; a failed resolution is not kept.

Negative control: the counts below are what a per-call resolution would make 3 (one per forward), and a layer
that kept its settings across groups would keep the first group's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_ring
from megatron_ring.megatron import ContextParallelConfigError, RingDotProductAttention
from megatron_ring.megatron.attention import comm_types, module as attn, qk_clip
from tests.helpers.ring_fakes import one_rank_group  # noqa: F401  (fixture)


def _module(group, **config):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, context_parallel_size=1, transformer_impl="local",
                            attention_dropout=0.0, **config)
    return RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                   pg_collection=SimpleNamespace(cp=group, tp=SimpleNamespace(size=lambda: 1)))


def _qkv(s=8, b=1):
    g = torch.Generator().manual_seed(0)
    return torch.randn(s, b, 4, 8, generator=g), torch.randn(s, b, 2, 8, generator=g), \
        torch.randn(s, b, 2, 8, generator=g)


def _count(monkeypatch):
    """Counts the resolutions the glue makes (each spied function, by name)."""
    counts: dict[str, int] = {}

    def spy(owner, name):
        real = getattr(owner, name)

        def counted(*a, **kw):
            counts[name] = counts.get(name, 0) + 1
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, counted)

    for owner, name in ((attn, "ring_config_from_env"), (attn, "kv_pieces_from_env"),
                        (comm_types, "layer_comm_type"), (qk_clip, "requested")):
        spy(owner, name)
    return counts


def _keyword_seen(monkeypatch, keyword: str) -> list:
    """The values of ``keyword`` the layer passes to ``ring_attention``, one per call."""
    seen: list = []
    real = megatron_ring.ring_attention

    def spy(*a, **kw):
        seen.append(kw[keyword])
        return real(*a, **kw)
    monkeypatch.setattr(megatron_ring, "ring_attention", spy)
    return seen


def test_settings_are_resolved_once_per_layer_and_group(one_rank_group, monkeypatch):  # noqa: F811
    m = _module(dist.group.WORLD)
    counts = _count(monkeypatch)
    q, k, v = _qkv()
    outs = [m(q, k, v, None) for _ in range(3)]
    assert counts == {"ring_config_from_env": 1, "kv_pieces_from_env": 1, "layer_comm_type": 1, "requested": 1}
    assert all(torch.equal(o, outs[0]) for o in outs)
    other = dist.new_group([0])  # Megatron rebinds pg_collection on the live module (eval-time CP)
    m.pg_collection = SimpleNamespace(cp=other, tp=m.pg_collection.tp)
    assert torch.equal(m(q, k, v, None), outs[0])
    assert counts["ring_config_from_env"] == 2 and counts["layer_comm_type"] == 2
    m(q, k, v, None)
    assert counts["ring_config_from_env"] == 2  # the second group's settings are kept too


def test_environment_is_read_at_a_layers_first_call(one_rank_group, monkeypatch):  # noqa: F811
    seen = _keyword_seen(monkeypatch, "kv_pieces")
    q, k, v = _qkv()
    m = _module(dist.group.WORLD)
    m(q, k, v, None)
    monkeypatch.setenv("MEGATRON_RING_KV_PIECES", "2")
    m(q, k, v, None)  # the layer keeps what it read at its first call
    _module(dist.group.WORLD)(q, k, v, None)  # a new layer (a new run) reads the variable
    assert seen == [None, None, 2]


def test_each_layer_names_its_calls_by_its_layer_number(one_rank_group, monkeypatch):  # noqa: F811
    """The layer passes ``call_id=layer_number``: calls of alike layers are told apart across ranks (a rank
    recomputing another layer under reentrant checkpointing raises on every rank; tests/test_divergent_calls.py)."""
    seen = _keyword_seen(monkeypatch, "call_id")
    q, k, v = _qkv()
    m = _module(dist.group.WORLD)
    m.layer_number = 7
    m(q, k, v, None)
    assert seen == [7]


def test_a_failed_resolution_is_not_kept(one_rank_group, monkeypatch):  # noqa: F811
    q, k, v = _qkv()
    m = _module(dist.group.WORLD)
    monkeypatch.setenv("MEGATRON_RING_KV_PIECES", "0")
    for _ in range(2):
        with pytest.raises(ContextParallelConfigError) as e:
            m(q, k, v, None)
        assert e.value.flag == "MEGATRON_RING_KV_PIECES"
    monkeypatch.delenv("MEGATRON_RING_KV_PIECES")
    m(q, k, v, None)


@pytest.mark.parametrize("mode", [False, True])
def test_deterministic_mode_is_passed_per_call_and_sets_no_process_state(one_rank_group, monkeypatch, mode):  # noqa: F811
    """``--deterministic-mode`` reaches the layer's own calls (``deterministic=True``); off, the calls follow the
    process default (None); building the layer changes no process-wide setting (it used to set it for good)."""
    from megatron_ring.kernels import block as K

    asked = _keyword_seen(monkeypatch, "deterministic")
    before = K.deterministic()
    m = _module(dist.group.WORLD, deterministic_mode=mode)
    assert K.deterministic() == before
    m(*_qkv(), None)
    assert asked == [True if mode else None] and K.deterministic() == before


def test_heads_not_divisible_by_tp_are_refused_naming_the_flag(one_rank_group):  # noqa: F811
    """The layer splits heads over TP as Megatron's core attention does; a count TP does not divide is a named
    error (Megatron's ``divide`` raised a bare AssertionError). Control: TP = 1 and TP = 2 build with 4 heads and 2
    query groups."""
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, context_parallel_size=1, transformer_impl="local",
                            attention_dropout=0.0)

    def build(tp):
        return RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(
            cp=dist.group.WORLD, tp=SimpleNamespace(size=lambda: tp)))

    assert build(1).num_attention_heads_per_partition == 4
    assert build(2).num_query_groups_per_partition == 1
    with pytest.raises(ContextParallelConfigError, match="--tensor-model-parallel-size.*num_query_groups = 2"):
        build(4)


def test_a_comm_type_in_two_places_names_both_and_the_fix():
    """Stock Megatron-LM's --cp-comm-type defaults to 'p2p' (TransformerConfig.cp_comm_type): with
    MEGATRON_RING_CP_COMM_TYPE set to another value, the error names both sources and what to do on stock
    Megatron-LM (it named a flag the user never passed); a per-layer list of the wrong length in the ring config
    names the ring config. Control: the same value in both places is accepted."""
    from megatron_ring.megatron import RingConfig

    ring = RingConfig(context_parallel_size=2, cp_comm_type=("all_gather",))
    with pytest.raises(ContextParallelConfigError, match="MEGATRON_RING_CP_COMM_TYPE.*leave MEGATRON_RING_CP_COMM_TYPE "
                                                         "unset"):
        comm_types.layer_comm_type(SimpleNamespace(cp_comm_type="p2p"), 1, None, ring)
    assert comm_types.layer_comm_type(SimpleNamespace(cp_comm_type="all_gather"), 1, None, ring) == "all_gather"
    two = RingConfig(context_parallel_size=2, cp_comm_type=("p2p", "a2a"))
    with pytest.raises(ContextParallelConfigError, match="the ring config .MEGATRON_RING_CP_COMM_TYPE.*2 per-layer"):
        two.comm_type_for_layer(3)


def test_the_stock_layout_refusal_names_where_the_layout_came_from(monkeypatch):
    """A layout from a registered ring (initialize_context_parallel's RingConfig) is named as such, not as
    MEGATRON_RING_LAYOUT (which the user may never have set)."""
    from megatron_ring.megatron.spec import stock

    import megatron_ring.megatron.groups.provider as provider

    monkeypatch.setattr(provider, "is_context_parallel_initialized", lambda: True)
    monkeypatch.setattr(provider, "get_ring_state", lambda: SimpleNamespace(config=SimpleNamespace(layout="striped")))
    with pytest.raises(ContextParallelConfigError) as e:
        stock.check_stock_layout()
    assert e.value.flag == "RingConfig.layout (initialize_context_parallel)", e.value


@pytest.mark.parametrize("padding,plain", [(AttnMaskType.padding_causal, AttnMaskType.causal),
                                           (AttnMaskType.padding, AttnMaskType.no_mask)])
def test_padding_mask_types_with_packed_batches(one_rank_group, padding, plain):  # noqa: F811
    """padding_causal / padding with packed (THD) batches: the documents and their padding are the
    packed_seq_params', so the call is the causal / no_mask one bit for bit (they were refused); without packed
    params they are refused by name at the call; arbitrary is refused at build. Control: the causal and the
    non-causal packed outputs differ (the mask type is not ignored)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    m = _module(dist.group.WORLD)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    q, k, v = _qkv()
    got = m(q, k, v, None, attn_mask_type=padding, packed_seq_params=params)
    want = m(q, k, v, None, attn_mask_type=plain, packed_seq_params=params)
    assert torch.equal(got, want)
    other = m(q, k, v, None, attn_mask_type=AttnMaskType.no_mask if plain is AttnMaskType.causal
              else AttnMaskType.causal, packed_seq_params=params)
    assert not torch.equal(got, other)
    with pytest.raises(NotImplementedError, match="with packed .THD. batches only"):
        m(q, k, v, None, attn_mask_type=padding)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            context_parallel_size=1, attention_dropout=0.0)
    with pytest.raises(NotImplementedError, match="supports attn_mask_type causal or no_mask"):
        RingDotProductAttention(cfg, 1, AttnMaskType.arbitrary, "self",
                                pg_collection=SimpleNamespace(cp=None, tp=SimpleNamespace(size=lambda: 1)))


def test_a_decode_step_at_cp1_is_megatrons_attention(one_rank_group):  # noqa: F811
    """Inference with a KV cache hands core attention fewer queries than keys (Megatron turns the mask off past the
    prompt): at CP = 1 every query sees every key, against the float64 attention (GQA 4:2, no_mask with 3 queries,
    causal with 1: the last position); refused by name: causal with several queries (Megatron refuses it too), a
    window. Negative control: a decode step computed causal-top-left (the first key only) misses."""
    from tests.helpers.numerics import max_err, score_bound, tol

    def attention_reference(q, k, v, causal=False):  # float64, [b, s, h, d], every query sees every key
        kk, vv = (t.repeat_interleave(q.shape[2] // t.shape[2], 2) for t in (k, v))
        p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5, -1)
        return torch.einsum("bhqk,bkhd->bqhd", p, vv)

    m = _module(dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(8, 2, 2, 8, generator=g), torch.randn(8, 2, 2, 8, generator=g)
    for sq, mask in ((3, AttnMaskType.no_mask), (1, AttnMaskType.causal)):
        q = torch.randn(sq, 2, 4, 8, generator=g)
        got = m(q, k, v, None, attn_mask_type=mask)
        qd, kd, vd = (t.transpose(0, 1).double() for t in (q, k, v))  # [b, s, h, d]
        ref = attention_reference(qd, kd, vd, causal=False).transpose(0, 1).reshape(sq, 2, -1)
        bound = tol(ref.abs().max().item(), dtype=torch.float32, n=8, sigma=score_bound(qd, kd))
        assert got.shape == (sq, 2, 32) and max_err(got, ref) <= bound
        first = attention_reference(qd, kd[:, :1], vd[:, :1], causal=False).transpose(0, 1).reshape(sq, 2, -1)
        assert max_err(got, first) > bound
    with pytest.raises(NotImplementedError, match="causal attention with query length 3 != key length 8"):
        m(torch.randn(3, 2, 4, 8), k, v, None)
    windowed = _module(dist.group.WORLD, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match="sliding window"):
        windowed(torch.randn(1, 2, 4, 8), k, v, None, attn_mask_type=AttnMaskType.no_mask)


@pytest.mark.parametrize("window", [(16,), (1, 2, 3)])
def test_a_window_size_without_two_values_is_named(one_rank_group, window):  # noqa: F811
    """Megatron-LM parses ``--window-size 16`` to ``(16,)``: named at build (it was an IndexError)."""
    with pytest.raises(ContextParallelConfigError, match="--window-size: needs two values"):
        _module(dist.group.WORLD, window_size=window)
