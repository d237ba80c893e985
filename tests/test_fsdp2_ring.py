"""FSDP2 x CP: examples/fsdp2_ring.py (FSDP2 ``fully_shard`` over a ``dp x cp`` device mesh, ring attention
over the mesh's ``cp`` group, AdamW) run under torchrun at world 2 (dp 1 x cp 2) and world 4 (dp 2 x cp 2),
every layout, against one process in float64 (same model, same initial weights, the whole batch and
sequence, full causal attention): the step-1 loss and the step-1 gradients of every parameter.

The runs are real processes that exit through the interpreter's shutdown (torchrun), so they also check
the example's exit (``shutdown()``: no rank aborts; see docs/fsdp2.md).

Tolerance (derived): the ring run computes in fp32, the reference in fp64. A value that goes through
``OPS`` chained fp32 operations, each a reduction of at most ``K`` terms (rounding errors add like a
random walk), is off by about ``eps32 * sqrt(K)`` per operation relative to the magnitudes involved; we
allow ``OPS`` of them, relative to the largest magnitude of the compared tensor. ``K``: the longest
reduction, the weight gradient's sum over every token of the global batch (dp * batch * sequence) or a
matmul over 2 * hidden; ``OPS``: per layer the forward and backward chains of LayerNorm, QKV, attention
(scores, softmax, values, merge), projection and the MLP's two matmuls (about 12), times the layers, plus
the head and the loss.
"""
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference import attention_reference

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp2_ring.py"
STEPS = 2
LAYOUTS = ("zigzag", "striped", "contiguous")


def _example():
    spec = importlib.util.spec_from_file_location("fsdp2_ring_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(ex, dp: int) -> tuple[float, dict]:
    """One process, float64: the step-1 loss and gradients."""
    model = ex.make_model(torch.float64)
    x, target = ex.make_data(dp, 1)[0]
    loss = F.mse_loss(model(x.double(), lambda q, k, v: attention_reference(q, k, v, causal=True)),
                      target.double())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _tolerance(ex, dp: int) -> float:
    eps = torch.finfo(torch.float32).eps
    k = max(dp * ex.BATCH_PER_DP * ex.SEQ, 2 * ex.HIDDEN)
    ops = 12 * ex.LAYERS + 4
    return ops * eps * math.sqrt(k)


@pytest.mark.slow
@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2)])
def test_fsdp2_over_dp_x_cp_mesh_matches_one_process(dp, cp, tmp_path):
    ex = _example()
    out = tmp_path / "result.pt"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp * cp}", str(EXAMPLE),
         f"--dp={dp}", f"--cp={cp}", "--layout=all", f"--steps={STEPS}", f"--out={out}"],
        env=env, capture_output=True, text=True, timeout=480)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "terminate called" not in log, log[-4000:]  # the exit abort (see docs/fsdp2.md)
    results = torch.load(out)
    ref_loss, ref_grads = _reference(ex, dp)
    tol = _tolerance(ex, dp)
    for layout in LAYOUTS:
        res = results[layout]
        assert len(res["losses"]) == STEPS
        assert abs(res["losses"][0] - ref_loss) <= tol * abs(ref_loss), (layout, res["losses"][0], ref_loss, tol)
        assert set(res["grads"]) == set(ref_grads)
        for name, g in res["grads"].items():
            ref = ref_grads[name]
            err = (g.double() - ref).abs().max().item()
            assert err <= tol * ref.abs().max().item(), (layout, name, err, ref.abs().max().item(), tol)
