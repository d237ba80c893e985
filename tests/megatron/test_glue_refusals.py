"""Megatron glue: the model's pg_collection.cp is honoured (or refused when it is not the registered
ring); configurations that would be silently wrong are refused naming the flag."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_ring.megatron import ContextParallelConfigError, RingConfig
from megatron_ring.megatron import attention as attn
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


def _attention_like(monkeypatch, pg_cp, registered_ranks):
    ranks = registered_ranks or [0]
    state = SimpleNamespace(size=len(ranks), group=_Group(ranks), global_ranks=tuple(ranks),
                            config=RingConfig(len(ranks)))
    monkeypatch.setattr(attn, "is_context_parallel_initialized", lambda: registered_ranks is not None)
    monkeypatch.setattr(attn, "get_ring_state", lambda: state)
    monkeypatch.setattr(attn, "_ranks", lambda g: g.ranks)
    cp = len(registered_ranks) if registered_ranks else 1
    return SimpleNamespace(config=SimpleNamespace(context_parallel_size=cp), _pg_cp=pg_cp), state


def test_pg_collection_cp_must_be_the_registered_ring(monkeypatch):
    fake, state = _attention_like(monkeypatch, _Group([0, 2]), [0, 1])
    with pytest.raises(ContextParallelConfigError, match=r"pg_collection.cp has global ranks \[0, 2\]"):
        attn.RingDotProductAttention._ring(fake)
    fake, state = _attention_like(monkeypatch, _Group([0, 1]), [0, 1])
    assert attn.RingDotProductAttention._ring(fake)[0] is state.group


def test_pg_collection_cp_is_used_without_a_registered_ring(monkeypatch):
    fake, _ = _attention_like(monkeypatch, _Group([3]), None)
    monkeypatch.setattr(attn, "is_context_parallel_initialized", lambda: False)
    group, cfg = attn.RingDotProductAttention._ring(fake)
    assert group is fake._pg_cp and cfg == RingConfig()
