"""A RoPE model whose rotary positions do not follow the ring's layout is refused, naming ``use_layout_rope``
(``megatron_ring/megatron/attention/rope_guard.py``); a model without RoPE, or with RoPE at the layout's
positions, is not.

Here: how the core attention learns from its parent whether the model applies RoPE (Megatron's attention
modules pass ``rotary_pos_emb`` by keyword; an MLA owns its ``rotary_pos_emb``), that the parent's hook goes after
its first call, and the refusal table. In a whole GPTModel at CP = 2 (every rank refuses; with the check off the
gradients are wrong, the negative control): tests/megatron/test_cp_equivalence.py and
test_documents_megatron.py."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ring.megatron import ContextParallelConfigError, RingDotProductAttention
from megatron_ring.megatron.attention import rope_guard
from tests.helpers.ring_fakes import one_rank_group  # noqa: F401  (fixture)


def _core(group):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, context_parallel_size=1, transformer_impl="local",
                            attention_dropout=0.0)
    return RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                   pg_collection=SimpleNamespace(cp=group, tp=SimpleNamespace(size=lambda: 1)))


class _Attention(torch.nn.Module):
    """Calls its core attention as Megatron's ``Attention.forward`` does, after (not) applying RoPE."""

    def __init__(self, group, own_rope: bool = False):
        super().__init__()
        if own_rope:  # an MLA: its RoPE is a submodule of its own
            self.rotary_pos_emb = torch.nn.Identity()
        self.core_attention = _core(group)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, packed_seq_params=None):
        q, k, v = hidden_states
        return self.core_attention(q, k, v, attention_mask)


def _qkv(s=8, b=1):
    g = torch.Generator().manual_seed(0)
    return torch.randn(s, b, 4, 8, generator=g), torch.randn(s, b, 2, 8, generator=g), \
        torch.randn(s, b, 2, 8, generator=g)


@pytest.mark.parametrize("how", ["keyword", "positional", "none", "own module"])
def test_the_parents_first_call_tells_whether_rope_is_applied(one_rank_group, how):  # noqa: F811
    parent = _Attention(dist.group.WORLD, own_rope=how == "own module")
    core = parent.core_attention
    assert core.rope_applied is None and len(parent._forward_pre_hooks) == 1
    emb = torch.zeros(8, 1, 1, 8)
    if how == "keyword":
        parent(_qkv(), None, rotary_pos_emb=emb)
    elif how == "positional":
        parent(_qkv(), None, None, None, emb)
    else:
        parent(_qkv(), None)
    assert core.rope_applied is (how != "none")
    assert not parent._forward_pre_hooks and not parent._forward_pre_hooks_with_kwargs  # gone after one call
    parent(_qkv(), None, rotary_pos_emb=None if how != "none" else emb)  # later calls change nothing
    assert core.rope_applied is (how != "none")
    assert bool(rope_guard._hook) == bool(rope_guard._waiting)  # none waits: the registration hook is gone too


def test_the_check_runs_at_the_parents_first_call_before_its_body(one_rank_group, monkeypatch):  # noqa: F811
    """Megatron applies RoPE in the parent's body (its THD split can raise there first): the first call's hook runs
    the core attention's check before it, with the call's ``packed_seq_params``."""
    parent = _Attention(dist.group.WORLD)
    seen = []
    monkeypatch.setattr(parent.core_attention, "check_rope", lambda packed, *a: seen.append(("check", packed)))
    body = parent.forward
    monkeypatch.setattr(parent, "forward", lambda *a, **kw: (seen.append(("body", None)), body(*a, **kw))[1])
    packed = object()
    parent(_qkv(), None, rotary_pos_emb=torch.zeros(8, 1, 1, 8), packed_seq_params=packed)  # (the toy ignores it)
    assert seen[:2] == [("check", packed), ("body", None)]  # (then the core attention checks its own call)


def test_a_deep_copy_learns_for_itself(one_rank_group):  # noqa: F811
    parent = _Attention(dist.group.WORLD)
    twin = copy.deepcopy(parent, {id(dist.group.WORLD): dist.group.WORLD})  # (a process group is not copied)
    twin(_qkv(), None, rotary_pos_emb=torch.zeros(8, 1, 1, 8))
    assert twin.core_attention.rope_applied is True and parent.core_attention.rope_applied is None
    parent(_qkv(), None)
    assert parent.core_attention.rope_applied is False


def test_a_core_attention_with_no_parent_is_never_refused(one_rank_group):  # noqa: F811
    core = _core(dist.group.WORLD)
    core(*_qkv(), None)
    assert core.rope_applied is None
    rope_guard.check(core, 4, "striped", False)
    rope_guard.check(core, 4, "striped", True)
    rope_guard._waiting.discard(core)  # (this module never joins a parent: leave no registration hook behind)


def _ring(applied=True, layout=None, packed_rope=None):
    return SimpleNamespace(rope_applied=applied, rope_layout=layout, packed_rope=packed_rope)


@pytest.mark.parametrize("ring,cp,layout,packed,refused", [
    (_ring(), 2, "zigzag", False, None),  # Megatron's own slicing is zigzag
    (_ring(), 2, "striped", False, "applies Megatron's own RoPE"),
    (_ring(), 4, "contiguous", False, "applies Megatron's own RoPE"),
    (_ring(), 1, "striped", False, None),  # no split
    (_ring(applied=False), 2, "striped", False, None),  # no RoPE (learned positions, NoPE)
    (_ring(layout="striped"), 2, "striped", False, None),  # use_layout_rope(model)
    (_ring(layout="striped"), 2, "zigzag", False, "use_layout_rope(model, 'striped')"),
    (_ring(layout="zigzag"), 2, "striped", False, "use_layout_rope(model, 'zigzag')"),
    (_ring(), 2, "zigzag", True, "packed (THD) batch"),  # Megatron's per-document split, any layout
    (_ring(layout="striped"), 2, "striped", True, "packed (THD) batch"),  # converted, but not linked
    (_ring(layout="striped", packed_rope=(object(),)), 2, "striped", True, None),  # the ring applies RoPE
], ids=["zigzag", "striped", "contiguous", "cp1", "no-rope", "linked", "linked-other", "linked-zigzag",
        "thd", "thd-unlinked", "thd-linked"])
def test_refusal_table(ring, cp, layout, packed, refused):
    if refused is None:
        rope_guard.check(ring, cp, layout, packed)
        return
    with pytest.raises(ContextParallelConfigError) as e:
        rope_guard.check(ring, cp, layout, packed)
    assert e.value.flag == "--cp-layout" and refused in str(e.value)
    assert "use_layout_rope(model) once after building the model" in str(e.value)
