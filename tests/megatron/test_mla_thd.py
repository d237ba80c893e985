"""Multi-latent attention on packed (THD) batches through the ring (see tests/megatron/mla_thd_workers.py).

- CP = 1 and CP = 2 with the stock ``--spec`` core attention on Megatron's per-document split equal Megatron's own
  attention on the batch's documents one at a time (loss and every parameter gradient; the model-level rule of
  tests/helpers/numerics.py). On megatron-core 0.19 MLA pads V to Q's head dim for THD batches and trims the
  core attention's output itself: the glue hands the ring V at its own head dim (cuDNN then takes the MLA head dims
  as they are where torch hands them to it, and the wire carries V unpadded) and pads the output back to the width
  Megatron trims (exact: Megatron keeps the first v_head_dim columns and drops the padding's gradient).
- The ring's own split of the packed stream (``batch_split="ring"``) at CP = 2 is refused by name
  (``TokenOrderError``): MLA's RoPE assumes Megatron's per-document order. Before, it failed in Megatron's RoPE
  or gave wrong gradients without an error.
- Negative control: the reference compared with the packed batch's loss shifted by a rounding-sized error fails.
"""
from __future__ import annotations

import pytest

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import Checks, add_model_grads, model_loss_tol
from tests.megatron import megatron_workers as W
from tests.megatron import mla_thd_workers as MW
from tests.megatron.conftest import RUN_TIMEOUT

pytestmark = pytest.mark.slow  # worker processes

_REF: dict = {}


def _reference() -> dict:
    if not _REF:
        _REF.update(run_distributed(MW.worker, 1, "documents", timeout=RUN_TIMEOUT)[0])
    return _REF


def _checks(got: dict, label: str) -> Checks:
    ref, sizes = _reference(), W.sizes(MW.M)
    assert "error" not in ref and "error" not in got, (ref.get("error"), got.get("error"))
    c = Checks(f"MLA packed THD {label} vs documents one at a time")
    c.add("loss", abs(got["loss"] - ref["loss"]), model_loss_tol(ref["loss"], step=1, **sizes))
    add_model_grads(c, got["grads"], ref["grads"], label=label, **sizes)
    return c


@pytest.mark.parametrize("world", [1, 2])
def test_mla_packed_thd_matches_the_documents_one_at_a_time(world):
    got = run_distributed(MW.worker, world, "thd", timeout=RUN_TIMEOUT)[0]
    _checks(got, f"CP={world}").check()
    # V reaches the ring at its own head dim (16), also where Megatron padded it to Q's (32, megatron-core 0.19)
    assert got["v_widths"] and {handed for _, handed in got["v_widths"]} == {16}, got["v_widths"]


def test_v_padded_by_megatron_handed_as_it_came_is_the_control():
    """Control of the widths check: with the glue handing V to the ring as it came, the ring gets what Megatron
    passed (Q's head dim where Megatron pads V) and the result is the same (exact either way: Megatron keeps only
    the first v_head_dim columns of the output and drops the padding's gradient)."""
    got = run_distributed(MW.worker, 2, "thd_padded_v", timeout=RUN_TIMEOUT)[0]
    _checks(got, "CP=2, V as Megatron padded it").check()
    assert all(came == handed for came, handed in got["v_widths"]), got["v_widths"]


def test_negative_control_a_shifted_loss_fails():
    got = dict(run_distributed(MW.worker, 1, "thd", timeout=RUN_TIMEOUT)[0])
    got["loss"] += 1e-3 * max(abs(got["loss"]), 1.0)
    assert _checks(got, "shifted").worst() > 1


def test_the_rings_own_split_is_refused_by_name():
    got = run_distributed(MW.worker, 2, "ring_split", timeout=RUN_TIMEOUT)
    for r in got:
        assert r.get("error", "").startswith("TokenOrderError: multi-latent attention on a packed (THD) batch"), r
        assert "batch_split='megatron'" in r["error"]
