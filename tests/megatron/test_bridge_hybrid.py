"""Megatron-Bridge hybrids: ``HybridModelProvider`` with the one line ``provider.hybrid_stack_spec =
ring_hybrid_stack_spec`` (or ``ring_spec(provider.hybrid_stack_spec)`` where one is set). Bridge's default is
megatron-core's TransformerEngine hybrid spec, which cannot be built without TransformerEngine; the
reference is the same provider with ``reference_hybrid_stack_spec`` (Megatron's own attention) at CP=1.
Pattern ``M*M-`` (Mamba layers through Megatron's own CP, attention on the ring), ``provide()``, one
forward/backward on Megatron's zigzag split, fp32: CP=2 equals CP=1, loss within the model-level bound (tests/helpers/numerics.py ``model_loss_tol``) and step-0 gradients
within the bound of tests/megatron/test_hybrid_model.py. Needs megatron-bridge (pinned; skipped where it is
not installed) and einops.
"""
from __future__ import annotations


import pytest
from tests.megatron.bridge_import import skip_without_bridge

pytestmark = pytest.mark.slow


skip_without_bridge()
pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel ships with megatron-core >= 0.19")
pytest.importorskip("einops", reason="Megatron's Mamba layers import einops (pinned; scripts/setup_env.sh)")

from tests.megatron import bridge_hybrid_workers as B  # noqa: E402
from tests.helpers.numerics import model_loss_tol  # noqa: E402
from tests.megatron.test_hybrid_model import _grad_diff, _grad_tol, _sizes  # noqa: E402


def test_bridge_hybrid_provider_cp2_equals_cp1(run):
    ref = run(B.bridge_hybrid_worker, 1, "M*M-", False)[0]
    got = run(B.bridge_hybrid_worker, 2, "M*M-", True)[0]
    assert abs(got["loss"] - ref["loss"]) <= model_loss_tol(ref["loss"], **_sizes("M*M-")), (got["loss"], ref["loss"])
    assert _grad_diff(got, ref) <= _grad_tol(ref["grads"])
