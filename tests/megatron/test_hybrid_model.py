"""HybridModel with ``ring_hybrid_stack_spec``: CP = 2 and 4 equal Megatron's own model at CP = 1.

Patterns ``*-*-`` (attention + MLP), ``M*M-`` (Mamba-2), ``G*G-`` (Gated DeltaNet), ``*E*-`` (MoE). The
attention layers run the ring; Mamba and GDN layers run Megatron's own CP (all-to-all over heads after
undoing the zigzag order) with the CPU opt-in's pure-torch kernels. Reference: the same stack with
Megatron's local ``DotProductAttention`` at CP = 1 (one process, same seeds and weights). fp32 throughout.

Tolerances: the loss of iteration i within the model-level bound ``i rel_fwd max(|loss|, 1)``
(tests/helpers/numerics.py ``model_loss_tol``; this model: 4 layers, FFN 128, rel_fwd 3.2e-5, so 1.6e-4 for a
loss near 4.9 at iteration 1); step-0 gradients within ``8 * eps32 * sqrt(tokens) * max|g|`` (a gradient entry is a sum
over the batch's tokens; CP changes only the order of that sum and of the attention merge; observed
~9e-8 against ~1.8e-6). The negative control feeds the model a contiguous split instead of the zigzag
one: the gradients must move far outside the bound, so the test sees a token-order disagreement.

Packed THD (``*-*-``, ``M*M-``, ``G*G-``, ``*E*-``; CP = 1, 2, 4): six documents of odd lengths, each padded to a
multiple of 2 x 4, split by Megatron's own per-document zigzag split, ``PackedSeqParams`` (qkv_format
``thd``, ``cu_seqlens`` and ``cu_seqlens_padded``). Reference: Megatron's own model (no ring) at CP = 1 on
the real documents one at a time (Megatron's local attention takes no packed input; documents see nothing of
each other, so this is what the packed step must equal). Same bounds, ``tokens`` = the packed stream's 80
(observed: loss <= 9.5e-7, gradients <= 1.2e-7 against >= 1.1e-6). Negative control: the packed batch split
zigzag over the whole stream (as BSHD is) is off by far (measured 8e-2 against 4.1e-6); documents padded to
a multiple of 2 only are refused by name at CP = 2. Attention dropout 0.1 on the packed batch: CP = 2, 4 equal
the ring at CP = 1.

The attention layers vs the float64 reference, in the same runs (no extra launch): every ``*`` layer's core
attention is captured at step 0 on every CP rank (q, k, v it was given, its output, the upstream gradient and
dq, dk, dv of the model's own backward), put back in global order from Megatron's documented split and held to
float64 attention with the same mask (causal; per document for THD; GQA) under the attention rule of
tests/helpers/numerics.py (tests/megatron/hybrid_attention_ref.py). Observed <= 0.063 of the bound; the negative
controls on the same captures (wrong token order, perturbed mask) exceed it by >= 1.7e4 x. Dropout 0 only: a
float64 reference of a dropout run would have to redraw the ring's own keep mask.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel ships with megatron-core >= 0.19")

from tests.helpers.numerics import Checks, model_loss_tol  # noqa: E402
from tests.megatron import hybrid_workers as HW  # noqa: E402
from tests.megatron.hybrid_attention_ref import layer_rows  # noqa: E402

try:
    import einops  # noqa: F401
    HAVE_EINOPS = True
except ImportError:
    HAVE_EINOPS = False
#: Megatron's Mamba layers import einops (pinned in requirements/; scripts/setup_env.sh installs it)
needs_einops = pytest.mark.skipif(not HAVE_EINOPS, reason="einops is not installed (Megatron's Mamba layers need it)")
PATTERNS = ["*-*-", pytest.param("M*M-", marks=needs_einops), "G*G-", "*E*-"]
STEPS = 2
_REF: dict = {}


def _sizes(pattern: str, tokens: int = HW.HYBRID["micro_batch"] * HW.HYBRID["seq"]) -> dict:
    """The model-level rule's sizes: one layer per pattern character, FFN 2 x hidden (hybrid_workers)."""
    m = HW.HYBRID
    return dict(seq=m["seq"], hidden=m["hidden_size"], layers=len(pattern), ffn=2 * m["hidden_size"], tokens=tokens)


def _grad_tol(ref_grads: dict, tokens: int = HW.HYBRID["micro_batch"] * HW.HYBRID["seq"]) -> float:
    gmax = max(float(g.abs().max()) for g in ref_grads.values())
    return 8 * torch.finfo(torch.float32).eps * math.sqrt(tokens) * gmax


def _reference(run, pattern: str, ring: bool = False, dropout: float = 0.0) -> dict:
    key = (pattern, ring, dropout)
    if key not in _REF:
        _REF[key] = run(HW.hybrid_worker, 1, HW.HYBRID, pattern, ring, STEPS, dropout)[0]
    return _REF[key]


def _grad_diff(a: dict, b: dict) -> float:
    return max(float((a["grads"][n] - g).abs().max()) for n, g in b["grads"].items())


def _compare(got: dict, ref: dict, what: str, pattern: str,
             tokens: int = HW.HYBRID["micro_batch"] * HW.HYBRID["seq"]) -> None:
    assert len(got["losses"]) == len(ref["losses"]), what
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        tol = model_loss_tol(b, step=step + 1, **_sizes(pattern, tokens))
        print(f"{what} step {step}: loss |d| {abs(a - b):.3g}, bound {tol:.3g}")
        assert abs(a - b) <= tol, f"{what}: step {step} loss {a} vs {b} (|d| {abs(a - b):.3g} > {tol:.3g})"
    assert set(got["grads"]) == set(ref["grads"]), what
    tol = _grad_tol(ref["grads"], tokens)
    worst = _grad_diff(got, ref)
    assert worst <= tol, f"{what}: step-0 gradients differ by {worst:.3g} > {tol:.3g}"


def _check_attention_layers(results: list, pattern: str, cp: int, packed: bool) -> None:
    """Every attention layer of the run (step 0, every CP rank's capture) vs the float64 reference: out, dq, dk,
    dv within the derived attention bound (tests/megatron/hybrid_attention_ref.py). Negative controls on the same
    captures, which must fail the bound: the shards put back in the wrong order (contiguous chunks for BSHD, a
    zigzag over the whole stream for THD; CP > 1) and a perturbed reference mask (bidirectional for BSHD, one
    causal stream without document boundaries for THD)."""
    what = f"{pattern} {'THD' if packed else 'BSHD'} CP={cp}"
    records = [r["attention"] for r in results]
    assert len(records[0]) == pattern.count("*"), f"{what}: captured {len(records[0])} core-attention calls"
    checks = Checks(f"hybrid attention layers vs float64, {what}")
    checks.extend(layer_rows(records, cp=cp, m=HW.HYBRID, packed=packed, label=what))
    for label, err, bound in checks.rows:
        print(f"{label}: max |d| {err:.3g}, bound {bound:.3g} ({err / bound:.3g} of it)")
    checks.check(min_rows=4 * pattern.count("*"))
    controls = [dict(mask="no_documents" if packed else "bidirectional")]
    controls += [dict(order="contiguous")] if cp > 1 else []
    for kw in controls:
        rows = layer_rows(records, cp=cp, m=HW.HYBRID, packed=packed, label=f"{what} control {kw}", **kw)
        print(f"{what} control {kw}: smallest err / bound {min(e / b for _, e, b in rows):.3g}")
        assert all(e > b for _, e, b in rows), f"negative control passed the bound: {rows}"


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_hybrid_cp_equals_megatron_cp1(run, pattern, cp):
    """The model at CP = 2, 4 equals Megatron's at CP = 1 (losses, step-0 gradients), and each attention layer of
    the same run equals the float64 reference (outputs and gradients of core attention)."""
    ref = _reference(run, pattern)
    results = run(HW.hybrid_worker, cp, HW.HYBRID, pattern, True, STEPS)
    _compare(results[0], ref, f"{pattern} CP={cp}", pattern)
    _check_attention_layers(results, pattern, cp, packed=False)


@pytest.mark.slow
@needs_einops
def test_hybrid_attention_dropout_cp_invariant(run):
    """Attention dropout 0.1: the ring keys dropout on global positions, so CP = 2 equals the ring at CP = 1
    (Megatron's own dropout draws per local tensor and is no reference here)."""
    ref = _reference(run, "M*M-", ring=True, dropout=0.1)
    plain = _reference(run, "M*M-")
    assert _grad_diff(ref, plain) > 100 * _grad_tol(plain["grads"]), "dropout 0.1 must change the gradients"
    got = run(HW.hybrid_worker, 2, HW.HYBRID, "M*M-", True, STEPS, 0.1)[0]
    _compare(got, ref, "M*M- dropout 0.1 CP=2", "M*M-")


@pytest.mark.slow
@needs_einops
def test_token_order_disagreement_is_seen(run):
    """Negative control: a contiguous batch split (Megatron's Mamba CP undoes a zigzag that is not there, and
    the ring and RoPE assume zigzag) must fail the bounds by far (measured: loss 3.7e-4 off at step 0, a
    fresh model's loss is near log(vocab) whatever the order, so the gradients carry the signal)."""
    ref = _reference(run, "M*M-")
    got = run(HW.hybrid_worker, 2, HW.HYBRID, "M*M-", True, STEPS, 0.0, "contiguous")[0]
    print(f"negative control: loss |d| {abs(got['losses'][0] - ref['losses'][0]):.3g}, "
          f"bound {model_loss_tol(ref['losses'][0], **_sizes('M*M-')):.3g}")
    assert abs(got["losses"][0] - ref["losses"][0]) > model_loss_tol(ref["losses"][0], **_sizes("M*M-")), \
        (got["losses"], ref["losses"])
    assert _grad_diff(got, ref) > 100 * _grad_tol(ref["grads"])


@pytest.mark.slow
@needs_einops
def test_control_without_the_spec_refuses_at_cp2(run):
    errors = run(HW.build_error_worker, 2, HW.HYBRID, "M*M-", False)
    assert all("context" in e.lower() and "parallel" in e.lower() for e in errors), errors


@pytest.mark.slow
@needs_einops
def test_dsa_layer_refused_by_name(run):
    errors = run(HW.build_error_worker, 1, HW.HYBRID, "MD-", True)
    assert "hybrid layer 'D'" in errors[0] and "DeepSeek sparse attention" in errors[0], errors


# --- packed THD -----------------------------------------------------------------------------------------
#: the packed stream's length (every document padded to a multiple of 2 x 4): the gradient sums run over it
PACKED_TOKENS = HW.packed_layout(HW.HYBRID)[1][-1]
THD_PATTERNS = ["*-*-", pytest.param("M*M-", marks=needs_einops), "G*G-", "*E*-"]


def _documents_reference(run, pattern: str) -> dict:
    """Megatron's own model (local attention, no ring) at CP = 1 on the packed batch's real documents one at a
    time (BSHD ``[1, n]``): what a packed step must equal, since documents see nothing of each other."""
    key = (pattern, "documents")
    if key not in _REF:
        _REF[key] = run(HW.hybrid_worker, 1, HW.HYBRID, pattern, False, STEPS, 0.0, "documents")[0]
    return _REF[key]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("pattern", THD_PATTERNS)
def test_hybrid_packed_thd_cp_equals_megatron_per_document(run, pattern, cp):
    """A packed THD batch (six documents of odd lengths 1..22, each padded to a multiple of 2 x 4, global
    ``cu_seqlens`` / ``cu_seqlens_padded`` in ``PackedSeqParams``) split by Megatron's own per-document zigzag
    split; Mamba / GDN through Megatron's CP (which undoes that order with ``thd_get_partitioned_indices``),
    attention on the ring in the same order. Equals Megatron's CP = 1 model run document by document, with
    the BSHD bounds (gradient sums over the packed stream's tokens); each attention layer of the same run equals
    the float64 per-document reference on the real tokens."""
    ref = _documents_reference(run, pattern)
    results = run(HW.hybrid_worker, cp, HW.HYBRID, pattern, True, STEPS, 0.0, "thd")
    _compare(results[0], ref, f"{pattern} THD CP={cp}", pattern, PACKED_TOKENS)
    _check_attention_layers(results, pattern, cp, packed=True)


@pytest.mark.slow
@needs_einops
def test_packed_token_order_disagreement_is_seen(run):
    """Negative control: the packed batch split zigzag over the whole stream (the BSHD split) instead of per
    document: Megatron's Mamba CP undoes a per-document order that is not there; the bounds must fail by far."""
    ref = _documents_reference(run, "M*M-")
    got = run(HW.hybrid_worker, 2, HW.HYBRID, "M*M-", True, STEPS, 0.0, "thd_stream")[0]
    assert _grad_diff(got, ref) > 100 * _grad_tol(ref["grads"], PACKED_TOKENS)


@pytest.mark.slow
@needs_einops
def test_packed_documents_not_padded_to_2cp_refused(run):
    """Documents padded to a multiple of 2 only (the stream's 60 tokens a multiple of 2 x 2), at CP = 2: refused
    by name at the first call (pad each document to a multiple of 2 x CP), never a silent mix."""
    m = dict(HW.HYBRID, pack_cp=1, doc_lengths=HW.PACKED["doc_lengths"] + (1,))
    assert HW.packed_layout(m)[1][-1] % 4 == 0
    with pytest.raises(Exception, match="every sequence must be padded to a multiple of 2 x"):
        run(HW.hybrid_worker, 2, m, "M*M-", True, 1, 0.0, "thd")


@pytest.mark.slow
@needs_einops
@pytest.mark.parametrize("cp", [2, 4])
def test_hybrid_packed_thd_attention_dropout_cp_invariant(run, cp):
    """Attention dropout 0.1 on the packed batch: CP = 2, 4 equal the ring at CP = 1 on the same packed batch
    (the ring keys dropout on positions in the packed stream, whichever rank holds them)."""
    key = ("M*M-", "thd", 0.1)
    if key not in _REF:
        _REF[key] = run(HW.hybrid_worker, 1, HW.HYBRID, "M*M-", True, STEPS, 0.1, "thd")[0]
    ref = _REF[key]
    plain = _documents_reference(run, "M*M-")
    assert _grad_diff(ref, plain) > 100 * _grad_tol(plain["grads"], PACKED_TOKENS), "dropout 0.1 must change them"
    got = run(HW.hybrid_worker, cp, HW.HYBRID, "M*M-", True, STEPS, 0.1, "thd")[0]
    _compare(got, ref, f"M*M- THD dropout 0.1 CP={cp}", "M*M-", PACKED_TOKENS)
