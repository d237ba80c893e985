"""Megatron-Bridge: the one line ``provider.transformer_layer_spec = ring_spec(provider.transformer_layer_spec)``.

A tiny Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings) built by Bridge's
``GPTModelProvider`` (``provide_distributed_model``: Bridge's ``get_model`` and Megatron DDP), one step
through Bridge's own ``gpt_step.forward_step`` (Bridge's batch fetch and ``masked_next_token_loss``,
Megatron's zigzag CP split) under Megatron-Core's forward-backward schedule, per-token loss, fp32, gloo.
Reference: the same provider at CP=1 without ``ring_spec`` (Megatron's own ``DotProductAttention``), one
process. CP=2 with ring attention equals it within the model-level bound (tests/helpers/numerics.py: loss within
``rel_fwd max(|loss|, 1)``, each gradient tensor's max |diff| within ``rel_grad max |g_ref|``), with Bridge's decentralized process groups (``use_decentralized_pg``: Bridge's
``_create_pg_collection``, no ``parallel_state``) and without (the MPU path); dense and MoE (4 experts,
top-2). Control: the same CP=2 run without ``ring_spec`` does not run (Megatron's local attention
refuses CP > 1), so the ring is what makes the CP=2 numbers.

Needs megatron-bridge (pinned: requirements/bridge-py312.txt, installed with ``--no-deps --target``; see
docs/megatron-runs.md "Megatron-Bridge"); skipped where it is not installed. Without TransformerEngine,
Bridge is imported through tests/megatron/bridge_import.py (an import-only stand-in for the one unguarded
``import transformer_engine.pytorch`` in Bridge's LoRA file; any use of it raises).
Multi-token prediction is not covered here: Bridge 0.6.2 builds the MTP block with
``use_transformer_engine=True`` written in (gpt_provider.py ``mtp_block_spec``), which needs TransformerEngine.
"""
from __future__ import annotations

import os

import pytest
from tests.megatron.bridge_import import skip_without_bridge

pytestmark = pytest.mark.slow


skip_without_bridge()

from tests.helpers.numerics import Checks, add_model_grads, model_loss_tol  # noqa: E402
from tests.megatron import bridge_workers as W  # noqa: E402

TIMEOUT = float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "240"))
#: the model-level rule's sizes (bridge_workers.MODEL: one micro-batch per step)
SIZES = dict(seq=W.MODEL["seq"], hidden=W.MODEL["hidden_size"], layers=W.MODEL["num_layers"],
             ffn=W.MODEL["ffn_hidden_size"], tokens=W.MODEL["micro_batch"] * W.MODEL["seq"])
_REF: dict = {}


def _reference(run, variant: str) -> dict:
    if variant not in _REF:
        ref = run(W.bridge_worker, 1, 1, False, False, variant)[0]
        assert ref["cores"] == {"DotProductAttention": W.MODEL["num_layers"]}, ref["cores"]
        _REF[variant] = ref
    return _REF[variant]


def test_stand_in_is_import_only(run):
    out = run(W.stand_in_worker, 1)[0]
    assert out["te_import"] == "ImportError", out
    assert out["uses"] == ["TransformerEngineStandInUsed"] * len(out["uses"]) and len(out["uses"]) >= 4, out


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("decentralized", [False, True], ids=["mpu", "decentralized_pg"])
def test_bridge_cp2_ring_equals_cp1(run, variant, decentralized):
    ref = _reference(run, variant)
    out = run(W.bridge_worker, 2, 2, True, decentralized, variant)
    c = Checks(f"Bridge {variant} CP=2 vs CP=1")
    for i, r in enumerate(out):
        assert r["cores"] == {"RingDotProductAttention": W.MODEL["num_layers"]}, r["cores"]
        assert r["cp_group"] == 2 and r["mpu"] is (not decentralized)
        assert r["tokens"] == ref["tokens"]
        c.add(f"rank {i} loss", abs(r["loss"] - ref["loss"]), model_loss_tol(ref["loss"], **SIZES))
        add_model_grads(c, r["grads"], ref["grads"], label=f"rank {i}", **SIZES)
    c.check()
    assert max(v.abs().max().item() for v in ref["grads"].values()) > 1e-3  # the comparison has teeth


def test_bridge_cp2_without_ring_spec_does_not_run(run):
    from tests.helpers.launch import WorkerError

    with pytest.raises(WorkerError):
        run(W.bridge_worker, 2, 2, False, False, "dense")
