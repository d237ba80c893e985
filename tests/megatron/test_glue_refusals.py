"""Megatron glue: the model's pg_collection.cp is honoured (or refused when it is not the registered
ring); configurations that would be silently wrong are refused naming the flag."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_ring.megatron import ContextParallelConfigError, RingConfig
from megatron_ring.megatron.attention import module as attn
from megatron_ring.megatron.config import refuse_mtp_without_zigzag


@pytest.mark.parametrize("layout", ["striped", "contiguous"])
def test_mtp_with_a_non_zigzag_layout_is_refused(layout):
    with pytest.raises(ContextParallelConfigError) as e:
        RingConfig(context_parallel_size=2, layout=layout).validate(mtp_num_layers=1, world_size=2)
    assert e.value.flag == "--cp-layout" and "--mtp-num-layers 1" in str(e.value)
    RingConfig(context_parallel_size=2, layout="zigzag").validate(mtp_num_layers=1, world_size=2)
    refuse_mtp_without_zigzag(None, layout, 2)
    args = argparse.Namespace(context_parallel_size=2, cp_layout=layout, mtp_num_layers=2, seq_length=64,
                              world_size=2)
    with pytest.raises(ContextParallelConfigError, match="--cp-layout"):
        RingConfig.from_args(args)


class _Group:
    def __init__(self, ranks):
        self.ranks = tuple(ranks)

    def size(self):
        return len(self.ranks)


def _attention_like(monkeypatch, pg_cp, registered_ranks, cp=None):
    ranks = registered_ranks or [0]
    state = SimpleNamespace(size=len(ranks), group=_Group(ranks), global_ranks=tuple(ranks),
                            config=RingConfig(len(ranks)))
    monkeypatch.setattr(attn, "is_context_parallel_initialized", lambda: registered_ranks is not None)
    monkeypatch.setattr(attn, "get_ring_state", lambda: state)
    monkeypatch.setattr(attn.groups, "group_ranks", lambda g: g.ranks)
    if cp is None:
        cp = pg_cp.size() if pg_cp is not None else len(ranks)
    return SimpleNamespace(config=SimpleNamespace(context_parallel_size=cp),
                           pg_collection=SimpleNamespace(cp=pg_cp)), state


def test_pg_collection_cp_is_followed_even_when_another_ring_is_registered(monkeypatch):
    """Megatron's group wins (eval-time CP rebinding replaces pg_collection on live modules); the
    registered ring's options still apply, its sub-rings only on its own group."""
    fake, state = _attention_like(monkeypatch, _Group([0, 2]), [0, 1])
    group, cfg, registered = attn.RingDotProductAttention._ring(fake)
    assert group is fake.pg_collection.cp and cfg is state.config and registered is None
    fake, state = _attention_like(monkeypatch, _Group([0, 1]), [0, 1])
    group, cfg, registered = attn.RingDotProductAttention._ring(fake)
    assert group is state.group and registered is state


def test_pg_collection_replaced_on_a_live_module_is_followed(monkeypatch):
    fake, _ = _attention_like(monkeypatch, _Group([0, 1, 2, 3]), None)
    assert attn.RingDotProductAttention._ring(fake)[0].ranks == (0, 1, 2, 3)
    fake.pg_collection = SimpleNamespace(cp=_Group([0, 1]))  # Megatron rebinds for eval at CP=2 ...
    with pytest.raises(ContextParallelConfigError, match="context_parallel_size=4 but its CP group has 2"):
        attn.RingDotProductAttention._ring(fake)  # ... and must rebind the config too
    fake.config.context_parallel_size = 2
    assert attn.RingDotProductAttention._ring(fake)[0].ranks == (0, 1)


def test_pg_collection_cp_is_used_without_a_registered_ring(monkeypatch):
    fake, _ = _attention_like(monkeypatch, _Group([3]), None)
    monkeypatch.setattr(attn, "is_context_parallel_initialized", lambda: False)
    group, cfg, registered = attn.RingDotProductAttention._ring(fake)
    assert group is fake.pg_collection.cp and cfg == RingConfig() and registered is None


def test_options_come_from_the_environment_without_a_registered_ring(monkeypatch):
    fake, _ = _attention_like(monkeypatch, _Group([0, 1]), None)
    monkeypatch.setenv("MEGATRON_RING_COMM_DTYPE", "bf16")
    monkeypatch.setenv("MEGATRON_RING_CP_COMM_TYPE", "allgather")
    _, cfg, _ = attn.RingDotProductAttention._ring(fake)
    assert cfg.comm_dtype == "bf16" and cfg.cp_comm_type == ("all_gather",)
    monkeypatch.setenv("MEGATRON_RING_COMM_DTYPE", "int4")
    with pytest.raises(ContextParallelConfigError) as e:
        attn.RingDotProductAttention._ring(fake)
    assert e.value.flag == "MEGATRON_RING_COMM_DTYPE"


def test_per_call_group_fields_are_checked(monkeypatch):
    fake, _ = _attention_like(monkeypatch, _Group([0, 1]), None)
    call = _Group([0, 1, 2, 3])
    group, _, _ = attn.RingDotProductAttention._ring(fake, SimpleNamespace(cp_group=call, local_cp_size=4))
    assert group is call  # the call's group, not the model's
    with pytest.raises(ContextParallelConfigError, match="local_cp_size=2 but packed_seq_params.cp_group has 4"):
        attn.RingDotProductAttention._ring(fake, SimpleNamespace(cp_group=call, local_cp_size=2))
    with pytest.raises(ContextParallelConfigError, match="local_cp_size=2 without a cp_group"):
        attn.RingDotProductAttention._ring(fake, SimpleNamespace(cp_group=None, local_cp_size=2))


def test_allgather_spelling_is_all_gather():
    assert RingConfig(cp_comm_type="allgather").cp_comm_type == ("all_gather",)
    assert RingConfig(cp_comm_type=["p2p", "allgather"]).cp_comm_type == ("p2p", "all_gather")
    from megatron_ring.megatron.attention.comm_types import layer_comm_type

    assert layer_comm_type(SimpleNamespace(cp_comm_type="allgather"), 1, None, None) == "all_gather"
    assert layer_comm_type(SimpleNamespace(cp_comm_type=["p2p", "allgather"]), 2, None, None) == "all_gather"
    assert layer_comm_type(SimpleNamespace(cp_comm_type=None), 1, "allgather", None) == "all_gather"


def test_per_group_facts_are_released_with_the_group(monkeypatch):
    import gc

    from megatron_ring.megatron.groups import resolve as groups

    monkeypatch.setattr(groups.dist, "get_process_group_ranks", lambda g: list(g.ranks))
    many = [_Group([i, i + 1]) for i in range(50)]
    assert [groups.group_ranks(g) for g in many] == [(i, i + 1) for i in range(50)]
    assert len(groups._RANKS) >= 50
    del many
    gc.collect()
    # its own groups only: a test before it in this process may leave live groups of its own
    left = [g for g in groups._RANKS.keys() if isinstance(g, _Group)]
    assert not left, "per-group entries must not outlive their groups"
