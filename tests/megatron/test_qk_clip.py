"""QK-clip through the ring (``--qk-clip`` / ``--log-max-attention-logit``): ``RingDotProductAttention``'s
``current_max_attn_logits`` as Megatron reads it.

Fast: the accumulation rule (detached; None -> the batch's max; then ``torch.max`` over micro-batches; None again
after Megatron's reset), the module at CP = 1 against the float64 max of the visible scores, nothing computed when
neither flag is set, the refusal by name on a megatron-core without QK-clip, and the answer to Megatron-LM's
TE-version question. Slow (gloo processes): a GPT model on the ring spec trained 3 steps with QK-clip clipping
from the first step, Megatron's own ``clip_qk`` (MAX all-reduce over DP x CP): at CP = 2 and 4 the reduced max
logits, the logged max and the losses equal CP = 1 within the model-level rule of tests/helpers/numerics.py;
negative control: some rank's own (unreduced) value misses the CP = 1 value.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ring.megatron import ContextParallelConfigError, RingDotProductAttention
from megatron_ring.megatron import compat
from megatron_ring.megatron.attention import qk_clip
from tests.helpers.numerics import Checks, max_logit_tol, model_loss_tol, score_bound
from tests.helpers.reference import max_logit_reference
from tests.helpers.ring_fakes import one_rank_group  # noqa: F401  (fixture)


def _module(**flags):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, context_parallel_size=1, transformer_impl="local",
                            attention_dropout=0.0, **flags)
    return RingDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                   pg_collection=SimpleNamespace(cp=dist.group.WORLD, tp=SimpleNamespace(size=lambda: 1)))


def _qkv(seed, s=16, b=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, 4, 8, generator=g, requires_grad=True), torch.randn(s, b, 2, 8, generator=g),
            torch.randn(s, b, 2, 8, generator=g))


def _ref(q, k):
    """float64 max logit per head of sbhd q, k under the causal mask."""
    return max_logit_reference(q.detach().transpose(0, 1), k.transpose(0, 1), causal=True).amax(1)


def test_accumulate_rule():
    a = torch.tensor([1.0, 5.0], requires_grad=True) * 1
    got = qk_clip.accumulate(None, a)
    assert not got.requires_grad and torch.equal(got, a.detach())
    got2 = qk_clip.accumulate(got, torch.tensor([3.0, 2.0]))
    assert torch.equal(got2, torch.tensor([3.0, 5.0])) and got2 is not got


@pytest.mark.parametrize("flag", ["qk_clip", "log_max_attention_logit"])
def test_module_accumulates_over_micro_batches(one_rank_group, flag):  # noqa: F811
    m = _module(**{flag: True})
    assert m.current_max_attn_logits is None
    checks, seen = Checks("core attention max logit"), []
    for seed in (1, 2):
        q, k, v = _qkv(seed)
        m(q, k, v, None).sum().backward()  # the statistic never joins the graph
        seen.append(_ref(q, k))
        want = torch.stack(seen).amax(0)
        got = m.current_max_attn_logits
        assert got.shape == (4,) and got.dtype == torch.float32 and not got.requires_grad
        checks.add(f"after micro-batch {len(seen)}", (got.double() - want).abs().max().item(),
                   max_logit_tol(sigma=max(score_bound(q.transpose(0, 1), k.transpose(0, 1)) for q, k, _ in
                                           [_qkv(s) for s in (1, 2)]), d=8))
    checks.check(min_rows=2)
    assert not torch.equal(seen[0], seen[1])  # the second micro-batch moved some head's max
    m.current_max_attn_logits = None  # Megatron's reset after clipping
    q, k, v = _qkv(3)
    m(q, k, v, None)
    assert (m.current_max_attn_logits.double() - _ref(q, k)).abs().max() < max_logit_tol(
        sigma=score_bound(q.transpose(0, 1), k.transpose(0, 1)), d=8)


def test_off_computes_nothing_and_output_unchanged(one_rank_group, monkeypatch):  # noqa: F811
    q, k, v = _qkv(4)
    on = _module(qk_clip=True)(q, k, v, None)
    import megatron_ring.core.max_logit as ml

    def boom(*a, **kw):
        raise AssertionError("the max-logit pass ran without QK-clip")

    monkeypatch.setattr(ml, "fold_task_max", boom)
    import megatron_ring.core.engine as engine

    monkeypatch.setattr(engine, "fold_task_max", boom)
    off = _module()
    assert torch.equal(off(q, k, v, None), on) and off.current_max_attn_logits is None


def test_refused_by_name_without_qk_clip(monkeypatch):
    monkeypatch.setattr(compat, "has_qk_clip", lambda: False)
    for field, flag in compat.QK_CLIP_FLAGS:
        with pytest.raises(ContextParallelConfigError) as e:
            qk_clip.requested(SimpleNamespace(**{field: True}))
        assert e.value.flag == flag
    assert qk_clip.requested(SimpleNamespace()) is False  # a config without the fields asks nothing


def test_megatron_lines_in_range_have_qk_clip():
    assert compat.has_qk_clip()  # 0.16.1 and 0.19.x both read current_max_attn_logits


def test_te_version_question_answered_for_the_ring_only(monkeypatch):
    asked = []
    check = compat.qk_clip_te_check(lambda v, eq=True: asked.append(v) or False)
    monkeypatch.setattr(compat, "has_transformer_engine", lambda: False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--qk-clip", "--spec", "megatron_ring.megatron.spec",
                                     "ring_layer_spec"])
    assert check("2.9.0") is True and asked == []
    assert check("2.8.0") is False and asked == ["2.8.0"]  # other questions: Megatron's answer
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--qk-clip"])  # no ring spec: Megatron's answer
    assert check("2.9.0") is False
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--spec=megatron_ring.megatron.spec", "ring_layer_spec"])
    assert check("2.9.0") is True
    monkeypatch.setattr(compat, "has_transformer_engine", lambda: True)  # TE installed: TE answers
    assert check("2.9.0") is False


def test_hybrid_stack_refused_where_clip_qk_cannot_walk_it(monkeypatch):
    from megatron_ring.megatron.spec.hybrid import _check_qk_clip

    attention, mamba = SimpleNamespace(self_attention=object()), SimpleNamespace()  # MambaLayer has no self_attention
    stack = SimpleNamespace(layer_type_list=list("*-M-"), layers=[attention, attention, mamba, attention])
    assert not compat.qk_clip_passes_layers_without_attention()  # 0.16.1, 0.19.x (and main) read it on every layer
    for field, flag in compat.QK_CLIP_FLAGS:
        with pytest.raises(ContextParallelConfigError, match=r"layer\(s\) 5 \('M'\)") as e:
            _check_qk_clip(stack, SimpleNamespace(**{field: True}), offset=2)
        assert e.value.flag == flag
    _check_qk_clip(stack, SimpleNamespace(), offset=0)  # no QK-clip asked: nothing refused
    _check_qk_clip(SimpleNamespace(layer_type_list=list("*-*-"), layers=[attention] * 4), SimpleNamespace(qk_clip=True),
                   offset=0)  # every layer has self_attention: Megatron's clip_qk walks it
    monkeypatch.setattr(compat, "qk_clip_passes_layers_without_attention", lambda: True)  # a line that skips them
    _check_qk_clip(stack, SimpleNamespace(qk_clip=True), offset=0)


def test_probe_asks_clip_qk_itself(monkeypatch):
    import megatron.core.optimizer.qk_clip as megatron_qk_clip

    def tolerant(model, log_max_only=False):  # a clip_qk that passes over layers without self_attention
        for chunk in model:
            assert [getattr(layer, "self_attention", None) for layer in chunk.module.module.decoder.layers] == [None]
        return 0.0

    compat.qk_clip_passes_layers_without_attention.cache_clear()
    try:
        monkeypatch.setattr(megatron_qk_clip, "clip_qk", tolerant)
        assert compat.qk_clip_passes_layers_without_attention()
        monkeypatch.undo()
        compat.qk_clip_passes_layers_without_attention.cache_clear()
        assert not compat.qk_clip_passes_layers_without_attention()  # control: Megatron's own reads it
    finally:
        compat.qk_clip_passes_layers_without_attention.cache_clear()


# ---- model level: CP > 1 equals CP = 1 -------------------------------------------------------------------------
STEPS, THRESHOLD = 3, 0.1  # the first step's max logits are ~0.08-0.15: some heads clip at once
_REF: dict = {}


def _cp1():
    from tests.helpers.launch import run_distributed
    from tests.megatron import qk_clip_workers as Q
    from tests.megatron.conftest import RUN_TIMEOUT

    if not _REF:
        _REF.update(run_distributed(Q.worker, 1, STEPS, THRESHOLD, timeout=RUN_TIMEOUT)[0])
    return _REF


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_equals_cp1(cp):
    from tests.helpers.launch import run_distributed
    from tests.megatron import megatron_workers as W
    from tests.megatron import qk_clip_workers as Q
    from tests.megatron.conftest import RUN_TIMEOUT

    ref = _cp1()
    assert any(bool((t > THRESHOLD).any()) for t in ref["reduced"][0])  # clipping happens in the first step
    assert any(not bool((t > THRESHOLD).all()) for t in ref["reduced"][0])  # and not on every head
    runs = run_distributed(Q.worker, cp, STEPS, THRESHOLD, timeout=RUN_TIMEOUT * 2)
    sizes = dict(W.sizes(Q.MODEL), tokens=Q.MICRO_BATCHES * Q.MODEL["micro_batch"] * Q.MODEL["seq"])
    checks, misses = Checks(f"QK-clip CP={cp} vs CP=1"), 0
    for rank, got in enumerate(runs):
        assert got["dpcp"] == cp and all(all(r) for r in got["reset"])  # Megatron reset every layer
        for step in range(STEPS):
            bound = lambda x: model_loss_tol(x, step=step + 1, **sizes)  # noqa: E731
            for layer, (g, r) in enumerate(zip(got["reduced"][step], ref["reduced"][step])):
                checks.add(f"rank {rank} step {step} layer {layer}", (g - r).abs().max().item(),
                           bound(r.abs().max().item()))
                misses += int((got["before"][step][layer] - r).abs().max().item() > bound(r.abs().max().item()))
            checks.add(f"rank {rank} step {step} logged", abs(got["logged"][step] - ref["logged"][step]),
                       bound(ref["logged"][step]))
            checks.add(f"rank {rank} step {step} loss", abs(got["losses"][step] - ref["losses"][step]),
                       bound(ref["losses"][step]))
    checks.check(min_rows=cp * STEPS * 4)
    assert misses > 0, "every rank's own max already equals CP=1: the comparison cannot see a missing reduce"
