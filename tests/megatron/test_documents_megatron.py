"""Documents through Megatron: ``--reset-attention-mask`` batches at TP x CP match Megatron's own CP = 1
model (local attention applying the same document mask): loss and every gradient after one step, and a
10-step loss curve at CP = 4 (with every gradient after step 1); ``PackedSeqParams`` (THD, padded variants) and ``window_size`` in
RingDotProductAttention vs the float64 per-document reference.

Tolerances (fp32) as tests/megatron/test_cp_equivalence.py: the model-level rule of tests/helpers/numerics.py
(loss of iteration i within ``i rel_fwd max(|loss|, 1)``, each gradient tensor within ``rel_grad max |g_ref|``).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.numerics import Checks, add_model_grads, model_curve_tols, model_loss_tol
from tests.megatron import doc_workers as D
from tests.megatron import megatron_workers as W
from tests.megatron.conftest import RUN_TIMEOUT
from tests.helpers.launch import run_distributed

_REF: dict = {}


def _reference(steps):
    if steps not in _REF:
        _REF[steps] = run_distributed(D.reference_worker, 1, W.MODEL, steps, timeout=RUN_TIMEOUT)[0]
    return _REF[steps]


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp", [(2, 2)], ids=["tp2cp2"])  # CP 4 alone: the curve test below
def test_reset_attention_mask_matches_megatron_cp1(run, tp, cp):
    ref = _reference(1)
    got = run(D.ring_worker, tp * cp, W.MODEL, tp, cp, ["zigzag", "striped"], 1)[0]
    c = Checks(f"documents TP={tp} x CP={cp} vs CP=1")
    for layout, res in got.items():
        c.add(f"{layout} loss", abs(res["losses"][0] - ref["losses"][0]), model_loss_tol(ref["losses"][0], **W.sizes()))
        add_model_grads(c, res["grads"], ref["grads"], label=layout, **W.sizes())
    c.check(min_rows=2)


def test_reset_attention_mask_negative_control():
    """The documents matter: the CP = 1 reference without the mask differs clearly from the one with it."""
    from megatron_ring.megatron.data.documents import document_mask

    b = D.doc_batch(W.MODEL, 0, 2)
    assert b["attention_mask"].any() and (b["position_ids"] == 0).sum() > 2
    mask, pos = document_mask(torch.tensor([[3, 0, 0, 4, 0]]), 0)
    assert pos.tolist() == [[0, 1, 0, 0, 1]]
    assert (~mask[0, 0]).int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                           [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.slow
def test_reset_attention_mask_cp4_curve_matches_cp1(run):
    steps = 10
    ref = _reference(steps)
    got = run(D.ring_worker, 4, W.MODEL, 1, 4, ["zigzag"], steps)
    c = Checks("documents CP=4 curve vs CP=1")
    add_model_grads(c, got[0]["zigzag"]["grads"], _reference(1)["grads"], label="step 0", **W.sizes())  # as TP x CP
    for k, r in enumerate(got):
        assert len(r["zigzag"]["losses"]) == steps, r["zigzag"]["losses"]
        for i, (a, b, t) in enumerate(zip(r["zigzag"]["losses"], ref["losses"], model_curve_tols(ref["losses"], **W.sizes()))):
            c.add(f"rank {k} iteration {i + 1}", abs(a - b), t)
    c.check()
    assert ref["losses"][-1] < ref["losses"][0] - 0.05


@pytest.mark.slow
def test_packed_seq_params_gpt_model_matches_megatron_cp1(run):
    """A whole GPTModel fed packed batches (``documents.packed_batch``: one THD stream, ``PackedSeqParams``
    with global cu_seqlens, as Megatron builds them; RoPE per document at the layout's positions) at
    CP = 4 (zigzag) and TP2 x CP2 (striped), vs Megatron's own CP = 1 model applying the same documents as a
    mask to the unpacked rows: loss and every gradient after one step. Built without ``use_layout_rope``, the
    model is refused at its first call, on every rank, naming it (Megatron would apply its own per-document RoPE
    split, which is not the ring's; its ``torch.split`` raised first where a document is not a multiple of 2 CP)."""
    ref = _reference(1)  # the two [1, 64] rows of doc_batch become one packed stream of 128 tokens
    configs = [(1, 4, "zigzag"), (2, 2, "striped")]
    got = run(D.ring_configs_worker, 4, W.MODEL, configs, 1, True)
    assert sorted(got[0]) == sorted(f"tp{tp}cp{cp}-{lay}" for tp, cp, lay in configs)
    c, loss_tol = Checks("packed GPTModel vs CP=1"), model_loss_tol(ref["losses"][0], **W.sizes())
    for name, res in got[0].items():
        c.add(f"{name} loss", abs(res["losses"][0] - ref["losses"][0]), loss_tol)
        add_model_grads(c, res["grads"], ref["grads"], label=name, **W.sizes())
    for k, r in enumerate(got[1:], 1):  # every rank reports the same (CP-reduced) loss
        for n in r:
            c.add(f"rank {k} {n} loss", abs(r[n]["losses"][0] - ref["losses"][0]), loss_tol)
    c.check()
    for r in got:  # the same model without use_layout_rope: refused on every rank, naming the fix
        for n in r:
            assert "packed (THD) batch" in r[n]["refused"] and "use_layout_rope(model)" in r[n]["refused"], n


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(2, "striped")])
def test_packed_seq_params_and_window(run, world, layout):
    errs = run(D.packed_attention_worker, world, layout)
    for e in errs:  # error / derived bound (tests/helpers/numerics.py), per window
        assert len(e) == 2 and max(e.values()) <= 1.0, e


def test_batch_helper_shards_packed_batches():
    """THD batch: [1, T] tensors split with the layout, cu_seqlens kept global; padded params -> boundaries."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.megatron import get_batch_on_this_cp_rank
    from megatron_ring.megatron.data.documents import packed_cu_seqlens

    T, cu = 16, torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    pos = torch.cat([torch.arange(a, b) - a for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())] + [torch.zeros(5)])
    batch = dict(tokens=torch.arange(T)[None], labels=torch.arange(T)[None] + 1, loss_mask=torch.ones(1, T),
                 position_ids=pos[None].long(), cu_seqlens=cu, max_seqlen=7)
    for layout in ("zigzag", "striped"):
        got = get_batch_on_this_cp_rank(batch, layout=layout, cp_size=4, cp_rank=1)
        idx = get_layout(layout).positions(T, 4, 1)
        assert torch.equal(got["tokens"][0], idx) and torch.equal(got["position_ids"][0], pos[idx].long())
        assert got["cu_seqlens"] is cu and got["max_seqlen"] == 7
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 4, 11]),
                             cu_seqlens_kv=torch.tensor([0, 3, 4, 11]),
                             cu_seqlens_q_padded=torch.tensor([0, 4, 8, 16]),
                             cu_seqlens_kv_padded=torch.tensor([0, 4, 8, 16]))
    assert packed_cu_seqlens(params).tolist() == [0, 3, 4, 5, 8, 15, 16]
