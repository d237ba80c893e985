"""Parity through Megatron-LM's own training loop (``megatron.training.pretrain``, examples/pretrain_ring_gpt.py).

Runs where ``megatron.training`` is importable (the megatron-core 0.19 wheel ships it: the Python 3.12
venv in CI); skipped otherwise. Reference: the same script at CP = 1 with Megatron's own local attention,
one process. Each ring run must match it per iteration (masked mean token loss, fp32) within the model-level
bound ``i rel_fwd max(|loss|, 1)`` at iteration i (tests/helpers/numerics.py ``model_curve_tols``); the
lossy wires within the bounds of docs/megatron-lm.md. Every layout runs once, and every parallel shape
(CP=2, CP=4, TP=2 x CP=2) once, with the distributed optimizer on and off and both recompute modes spread
over the runs (each run is a torchrun launch of 1-4 CPU processes: the cases are combined to keep CI lean).
"""
from __future__ import annotations

import os

import pytest

from tests.helpers.launch import ROOT, masked_mean_losses, torchrun
from tests.helpers.numerics import Checks, model_curve_tols
from tests.megatron.pretrain_cli import PRETRAIN_MARKS, CPU_FLAGS, MODEL_SIZES, gpt_args


pytestmark = PRETRAIN_MARKS

SCRIPT = os.path.join(ROOT, "examples", "pretrain_ring_gpt.py")
ITERS = 4
MICRO_BATCHES = 2  # global batch 4 / (micro batch 2 x DP 1)
MODEL = gpt_args(ITERS)
CPU = CPU_FLAGS



def pretrain(tmp_path, name: str, nproc: int, *extra: str) -> list[float]:
    """Per-iteration masked mean loss (float64 sums over DP x CP) of one torchrun launch."""
    log = tmp_path / f"{name}.loss"
    p = torchrun(SCRIPT, nproc, *MODEL, *CPU, *extra, env={"MEGATRON_RING_LOSS_LOG": str(log)}, name=name)
    assert "iteration        1/" in p.stdout, "Megatron's own per-iteration log is missing"
    losses = masked_mean_losses(log, MICRO_BATCHES)
    assert len(losses) == ITERS, losses
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = pretrain(tmp_path_factory.mktemp("ref"), "cp1", 1)
    assert ref[-1] < ref[0] - 0.05, f"the reference must actually train: {ref}"
    return ref


CASES = {  # name: (processes, flags); every layout, every shape, dist-opt on/off, recompute full/selective
    "cp2-zigzag-distopt-selective": (2, "--context-parallel-size 2 --cp-layout zigzag --use-distributed-optimizer "
                                        "--recompute-granularity selective"),
    "cp4-striped-full-recompute": (4, "--context-parallel-size 4 --cp-layout striped --recompute-granularity full "
                                      "--recompute-method uniform --recompute-num-layers 1"),
    "tp2cp2-contiguous-distopt": (4, "--context-parallel-size 2 --tensor-model-parallel-size 2 --cp-layout "
                                     "contiguous --use-distributed-optimizer"),
}
WIRES = {"bf16": 2e-3, "fp8": 2e-2}  # per-iteration |loss - CP=1 loss| bounds (docs/megatron-lm.md)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pretrain_ring_matches_cp1(tmp_path, reference, case):
    nproc, flags = CASES[case]
    got = pretrain(tmp_path, case, nproc, *flags.split())
    c = Checks(f"pretrain() {case} vs CP=1")
    for i, (a, b, t) in enumerate(zip(got, reference, model_curve_tols(reference, **MODEL_SIZES))):
        c.add(f"iteration {i + 1}", abs(a - b), t)
    c.check(min_rows=ITERS)


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_pretrain_lossy_wire_within_bound(tmp_path, reference, wire):
    got = pretrain(tmp_path, wire, 2, "--context-parallel-size", "2", "--cp-comm-dtype", wire)
    diffs = [abs(a - b) for a, b in zip(got, reference)]
    assert max(diffs) <= WIRES[wire], (wire, diffs)
    assert max(diffs) > 0, "a lossy wire that changes nothing was not on the wire"
