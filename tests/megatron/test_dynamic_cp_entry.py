"""``examples/pretrain_ring_gpt.py --dynamic-cp``: Megatron-LM's loop starts, rank 0 prints the dynamic-CP plan
of the global batch (ours vs Megatron's hybrid-CP policy vs fixed CP), and training runs on as before."""
import pytest

from megatron_ring.megatron.compat import has_megatron_training
from tests.helpers.launch import torchrun
from tests.megatron.test_pretrain_loop import CPU, MODEL, SCRIPT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_megatron_training(),
                                                   reason="megatron.training is not installed")]


def test_entry_script_plans_dynamic_cp(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("40 8 8 16\n64 4 4 4  # second global batch\n")
    p = torchrun(SCRIPT, 2, *MODEL, *CPU, "--context-parallel-size", "2", "--dynamic-cp", "--dynamic-cp-lengths",
                 lens, "--dynamic-cp-batches", "2", name="dynamic-cp entry")
    out = p.stdout
    assert "[dynamic-cp] global batch 0: 4 documents, 72 tokens, DP x CP = 2" in out
    assert "[dynamic-cp] global batch 1: 4 documents, 76 tokens" in out
    for row in ("fixed CP=1 DP=2", "fixed CP=2 DP=1", "Megatron balanced", "ours"):
        assert row in out
    assert "iteration        4/" in out
