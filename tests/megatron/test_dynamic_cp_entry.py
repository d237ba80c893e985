"""``examples/pretrain_ring_gpt.py --dynamic-cp``: Megatron-LM's loop starts, rank 0 prints the dynamic-CP plan
of the global batch (ours vs Megatron's hybrid-CP policy vs fixed CP), and training runs on as before."""
import os
import subprocess
import sys

import pytest

from megatron_ring.megatron.compat import has_megatron_training
from pretrain_cli import free_port
from test_pretrain_loop import CPU, MODEL, SCRIPT, TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_megatron_training(),
                                                   reason="megatron.training is not installed")]


def test_entry_script_plans_dynamic_cp(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("40 8 8 16\n64 4 4 4  # second global batch\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(SCRIPT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), SCRIPT, *MODEL, *CPU, "--context-parallel-size", "2",
           "--dynamic-cp", "--dynamic-cp-lengths", str(lens), "--dynamic-cp-batches", "2"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    out = p.stdout
    assert "[dynamic-cp] global batch 0: 4 documents, 72 tokens, DP x CP = 2" in out
    assert "[dynamic-cp] global batch 1: 4 documents, 76 tokens" in out
    for row in ("fixed CP=1 DP=2", "fixed CP=2 DP=1", "Megatron balanced", "ours"):
        assert row in out
    assert "iteration        4/" in out
