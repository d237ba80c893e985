"""Known answers of the CP doctor on the stock-style pretrain_gpt.py (megatron-core 0.19 ``pretrain()``).

* dense -> invariant (exit 0);
* ``--mtp-num-layers 1`` -> the MTP loss's per-CP-rank weighting is flagged and named (NVIDIA/Megatron-LM#3959)
  (exit 1), and with ``MEGATRON_RING_MTP_CP_INVARIANT=1`` the same command is invariant (exit 0);
* MoE (4 experts, top-2, load-balancing aux loss 0.01, alltoall dispatcher) -> invariant on 0.19.2, aux loss
  included: megatron-core's router reduces the tokens per expert over the TP x CP group and scales the aux
  loss by the local token count x that group's size, which cancels the per-rank loss scaling
  (megatron/core/transformer/moe/router.py, ``_apply_aux_loss``); the test also checks the aux loss is
  recorded, so the check is not vacuous.
Tiny model (2 layers, hidden 64, sequence 64), 2 iterations, CP=2; CP=1 runs are shared through ``--cache``.
"""
from __future__ import annotations

import os

import pytest
from tests.megatron.pretrain_cli import CPU_FLAGS, PRETRAIN_MARKS, gpt_args, run_doctor

pytestmark = PRETRAIN_MARKS

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "stock_pretrain_gpt.py")
MTP = ["--mtp-num-layers", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall"]


def doctor(tmp_path, cache, *extra_args: str, env_extra: dict | None = None) -> tuple[int, dict, str]:
    return run_doctor(tmp_path, cache, SCRIPT, [*gpt_args(2), *CPU_FLAGS, *extra_args], env_extra=env_extra)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("doctor-cache")


def test_dense_is_invariant(tmp_path, cache):
    rc, data, out = doctor(tmp_path, cache)
    assert rc == 0, out
    assert data["invariant"] and data["results"][0]["verdict"].endswith("within fp32 rounding"), out
    assert "CP=1" in out and "| verdict" in out, out


def test_mtp_loss_is_flagged_then_invariant_with_the_switch(tmp_path, cache):
    rc, data, out = doctor(tmp_path / "megatron", cache, *MTP)
    assert rc == 1, out
    res = data["results"][0]
    assert res["training_differs"] and res["causes"][0]["key"] == "mtp", (res["causes"], out)
    assert "Megatron-LM#3959" in out and res["gradients_beyond_bound"][0][0].startswith("mtp."), out
    rc, data, out = doctor(tmp_path / "invariant", cache, *MTP, env_extra={"MEGATRON_RING_MTP_CP_INVARIANT": "1"})
    assert rc == 0, out
    assert data["invariant"], out


def test_moe_with_aux_loss_is_invariant_on_this_release(tmp_path, cache):
    rc, data, out = doctor(tmp_path, cache, *MOE)
    assert rc == 0, out
    res = data["results"][0]
    aux = [r for r in res["rows"] if r["quantity"] == "load_balancing_loss (logged)"]
    assert len(aux) == 2 and all(r["verdict"] == "ok" for r in aux), out
