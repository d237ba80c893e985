"""``cp_invariant_mtp_loss``: Megatron's MTP token count at CP > 1, made the count CP=1 uses (shared by the ranks).

Reference: the whole sequence rolled on one process (``torch.roll`` with the last position zeroed, what
Megatron's ``roll_tensor`` does at CP=1). Megatron's own CP roll is checked to be that sequence's zigzag
share (so only the count differs); its per-rank counts differ from each other (the defect the wrapper
removes), the wrapped count is the whole count / CP on every rank (exact: counts are integers in float64).
The end-to-end check (loss curve CP=2 = CP=1 with MTP) is tests/megatron/test_stock_spec.py.
"""
from __future__ import annotations

from tests.megatron import mtp_workers as W
import pytest


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_mtp_token_count_is_cp_invariant_after_the_opt_in(run, world):
    results = run(W.mtp_count_worker, world, 32)
    whole = results[0]["whole"]
    assert sum(r["megatron"] for r in results) == whole  # Megatron's counts add up to the sequence's ...
    assert len({r["megatron"] for r in results}) > 1, results  # ... but differ by rank: per-rank weights
    for r in results:
        assert r["megatron_rolled_ok"] and r["rolled_ok"] and r["cp1_ok"], r
        assert r["exact"] == whole / world, (r, whole)
        assert "megatron.core.transformer.multi_token_prediction" in r["wrapped"] and r["idempotent"], r


def test_the_environment_switch_names_itself(monkeypatch):
    from megatron_ring.megatron.config import ContextParallelConfigError
    from megatron_ring.megatron.data.mtp_loss import mtp_cp_invariant_requested

    for raw, want in (("", False), ("0", False), ("off", False), ("1", True), ("true", True)):
        monkeypatch.setenv("MEGATRON_RING_MTP_CP_INVARIANT", raw)
        assert mtp_cp_invariant_requested() is want
    monkeypatch.setenv("MEGATRON_RING_MTP_CP_INVARIANT", "maybe")
    with pytest.raises(ContextParallelConfigError, match="MEGATRON_RING_MTP_CP_INVARIANT"):
        mtp_cp_invariant_requested()
