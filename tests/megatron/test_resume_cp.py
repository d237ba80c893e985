"""Resume at another CP size with Megatron's own distributed checkpointing, attention dropout ON.

Two loops, each saving at CP = 4 and resuming at CP = 2 and CP = 1 (continued per-iteration loss equal to
the uninterrupted CP = 4 run within the model-level bound ``i rel_fwd max(|loss|, 1)`` at iteration i,
tests/helpers/numerics.py ``model_loss_tol``), each with a negative control:

* Megatron-LM's ``pretrain()`` with ``--save/--load --ckpt-format torch_dist`` where ``megatron.training``
  is installed (the megatron-core 0.19 wheel: the Python 3.12 venv);
* otherwise (megatron-core 0.16.1: the Python 3.11 venv) a Megatron-Core loop with
  ``megatron.core.dist_checkpointing`` (tests/megatron/resume_workers.py). One loop per venv keeps the
  file's runtime near 90 s on a quiet 2-core machine (each case is a torchrun launch).

``pretrain()``: it runs examples/pretrain_ring_gpt_any_cp.py (ring attention at every CP size) at CP = 4 for ITERS iterations
and saves a ``torch_dist`` checkpoint at iteration SAVE_AT. Resumed from it at CP = 2 and at CP = 1, the
continued per-iteration loss (masked mean token loss, fp32 model, float64 sums over DP x CP) must equal the
uninterrupted CP = 4 run within that bound. Attention dropout is 0.1: the ring's dropout mask depends only on
(seed, layer, head, global positions), and Megatron checkpoints the RNG tracker it is drawn from per
(PP, TP) rank (shared over DP x CP), so the masks continue identically at any CP size.

Negative control (so the test can fail): resumed at CP = 1 with ``--no-load-rng`` the tracker restarts
from its seed, the dropout masks differ and the loss must leave the bound (measured: 3.8 x the bound with
``pretrain()``; 2e-3 off, the reordering difference is ~1e-7).
"""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers.launch import ROOT, masked_mean_losses, torchrun
from tests.helpers.numerics import model_loss_tol
from tests.megatron.pretrain_cli import CPU_FLAGS, MODEL_SIZES, gpt_args

from megatron_ring.megatron.compat import has_megatron_training

pytestmark = [pytest.mark.slow]
needs_training = pytest.mark.skipif(not has_megatron_training(),
                                    reason="megatron.training is not installed (megatron-core >= 0.19 wheel or "
                                           "a Megatron-LM checkout); CI runs this in the Python 3.12 venv")
core_loop_only = pytest.mark.skipif(has_megatron_training(),
                                    reason="megatron.training is installed: the resume is tested through "
                                           "Megatron-LM's pretrain() here; the Megatron-Core loop runs in the "
                                           "venv without it (megatron-core 0.16.1)")

SCRIPT = os.path.join(ROOT, "examples", "pretrain_ring_gpt_any_cp.py")
CORE_WORKER = os.path.join(ROOT, "tests", "megatron", "resume_workers.py")
ITERS, SAVE_AT = 6, 3
MICRO_BATCHES = 2  # global batch 4 / (micro batch 2 x DP 1)
#: the Megatron-Core loop's model (resume_workers.MODEL): FFN 2 x hidden, one micro-batch of 2 per iteration
CORE_SIZES = dict(seq=64, hidden=64, layers=2, ffn=128, tokens=2 * 64)


def _ratio(got: list[float], want: list[float], sizes: dict) -> float:
    """The worst |resumed - uninterrupted| / bound over the continued iterations SAVE_AT + 1 .. ITERS."""
    assert len(got) == len(want) == ITERS - SAVE_AT, (got, want)
    r = max(abs(a - b) / model_loss_tol(b, step=SAVE_AT + 1 + i, **sizes) for i, (a, b) in enumerate(zip(got, want)))
    print(f"worst |resumed - uninterrupted| / bound: {r:.3g}")
    return r


MODEL = gpt_args(ITERS, attention_dropout=0.1, extra="--ckpt-format torch_dist")
CPU = CPU_FLAGS



def pretrain(tmp_path, name: str, cp: int, *extra: str) -> list[float]:
    """Per-iteration masked mean loss of one torchrun launch at CP = ``cp`` (the iterations it ran)."""
    log = tmp_path / f"{name}.loss"
    torchrun(SCRIPT, cp, *MODEL, *CPU, "--context-parallel-size", str(cp), *extra,
             env={"MEGATRON_RING_LOSS_LOG": str(log)}, name=name)
    return masked_mean_losses(log, MICRO_BATCHES)


@pytest.fixture(scope="module")
def saved_cp4(tmp_path_factory):
    """The uninterrupted CP = 4 run (its checkpoint at SAVE_AT is the one every resume loads)."""
    tmp = tmp_path_factory.mktemp("cp4")
    ckpt = tmp / "ckpt"
    losses = pretrain(tmp, "cp4", 4, "--save", str(ckpt), "--save-interval", str(SAVE_AT))
    assert len(losses) == ITERS, losses
    assert (ckpt / f"iter_{SAVE_AT:07d}").is_dir(), sorted(os.listdir(ckpt))
    assert losses[-1] < losses[0] - 0.05, f"the run must actually train: {losses}"
    return ckpt, losses


def resume(tmp_path, saved_cp4, cp: int, *extra: str) -> tuple[list[float], list[float]]:
    ckpt, full = saved_cp4
    got = pretrain(tmp_path, f"resume-cp{cp}", cp, "--load", str(ckpt), "--ckpt-step", str(SAVE_AT),
                   "--exit-on-missing-checkpoint", *extra)
    assert len(got) == ITERS - SAVE_AT, f"the resumed run must start after iteration {SAVE_AT}: {got}"
    return got, full[SAVE_AT:]


@needs_training
@pytest.mark.parametrize("cp", [2, 1])
def test_resume_at_another_cp_size_continues_the_cp4_curve(tmp_path, saved_cp4, cp):
    got, want = resume(tmp_path, saved_cp4, cp)
    assert _ratio(got, want, MODEL_SIZES) <= 1, (cp, got, want, _ratio(got, want, MODEL_SIZES))


@needs_training
def test_resume_without_the_rng_state_differs(tmp_path, saved_cp4):
    """The dropout masks come from the checkpointed RNG tracker: without it the curve must move."""
    got, want = resume(tmp_path, saved_cp4, 1, "--no-load-rng")
    assert _ratio(got, want, MODEL_SIZES) > 1, (got, want)  # measured 3.8 x the bound


# ----------------------------------------------------------------------------------------------
# Megatron-Core loop with megatron.core.dist_checkpointing (any megatron-core)
# ----------------------------------------------------------------------------------------------
def core_run(tmp_path, name: str, cp: int, ckpt, start: int, save_at: int | None, load_rng: bool = True) -> list[float]:
    out = tmp_path / f"{name}.json"
    torchrun(CORE_WORKER, cp, cp, ckpt, start, ITERS, -1 if save_at is None else save_at, 1 if load_rng else 0, out,
             name=name)
    losses = json.loads(out.read_text())
    assert len(losses) == ITERS - start, losses
    return losses


@pytest.fixture(scope="module")
def core_saved_cp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core-cp4")
    ckpt = tmp / "ckpt"
    losses = core_run(tmp, "cp4", 4, ckpt, 0, SAVE_AT)
    assert (ckpt / "metadata.json").is_file(), "no torch_dist checkpoint was written"
    assert losses[-1] < losses[0] - 0.05, f"the run must actually train: {losses}"
    return ckpt, losses


@core_loop_only
@pytest.mark.parametrize("cp", [2, 1])
def test_core_loop_resume_at_another_cp_size(tmp_path, core_saved_cp4, cp):
    ckpt, full = core_saved_cp4
    got = core_run(tmp_path, f"resume-cp{cp}", cp, ckpt, SAVE_AT, None)
    r = _ratio(got, full[SAVE_AT:], CORE_SIZES)
    assert r <= 1, (cp, got, full[SAVE_AT:], r)


@core_loop_only
def test_core_loop_resume_without_the_rng_state_differs(tmp_path, core_saved_cp4):
    ckpt, full = core_saved_cp4
    got = core_run(tmp_path, "resume-norng", 1, ckpt, SAVE_AT, None, load_rng=False)
    r = _ratio(got, full[SAVE_AT:], CORE_SIZES)
    assert r > 1, (got, full[SAVE_AT:], r)
