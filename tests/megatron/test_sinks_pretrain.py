"""Learnable attention sinks through Megatron-LM's own ``pretrain()``: saved at TP = 2 x CP = 2 with
``--ckpt-format torch_dist``, resumed at TP = 2 x CP = 2 and at TP = 1 x CP = 2, every head's offset intact.

tests/megatron/sinks_pretrain_worker.py runs the stock-style pretrain_gpt.py mirror
(tests/megatron/stock_pretrain_gpt.py: ``--spec megatron_ring.megatron.spec ring_layer_spec``, Megatron's
``--softmax-type learnable``) and logs, at every forward step, each rank's ``softmax_offset`` of every layer
(its TP rank's heads). The TP-gathered offsets (TP ranks' heads in order; every DP x CP replica of a TP rank
must agree) are compared exactly:

1. saver: TP = 2 x CP = 2, ITERS iterations, checkpoint at SAVE_AT. The offsets it trains with at iteration
   SAVE_AT + 1 are the ones in that checkpoint; they must differ from the initial ones and between TP ranks
   (else the check could not tell a lost head from a kept one).
2. resumed at TP = 2 x CP = 2 (``--load``): the offsets at its first forward step equal the saver's, every
   head, exactly; the per-iteration loss continues the saver's curve within the model-level bound
   ``i rel_fwd max(|loss|, 1)`` at iteration i (tests/helpers/numerics.py ``model_loss_tol``).
3. resumed at TP = 1 x CP = 2 (torch_dist reshards; no extra flag needed): every head on every rank, exactly;
   the curve within the same bound (TP = 1 sums in another order).

4. a checkpoint written by Megatron's own ``DotProductAttention`` (TP = 2, CP = 1, no ``--spec``) loads into
   the ring model at TP = 1 x CP = 2, every head exact: the ring's sharding is Megatron's, key and axis.

Negative control: with ``RingDotProductAttention`` checkpointed by ``MegatronModule``'s default
``sharded_state_dict`` (the offset taken as replicated over TP), a TP = 2 run saved and resumed the same way
(CP = 1, world 2, to keep the time down) gives TP rank 1 TP rank 0's heads: the check of step 2 fails.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers.launch import ROOT, masked_mean_losses, torchrun
from tests.helpers.numerics import model_loss_tol
from tests.megatron.pretrain_cli import CPU_FLAGS, MODEL_SIZES, PRETRAIN_MARKS, gpt_args

pytestmark = PRETRAIN_MARKS

WORKER = os.path.join(ROOT, "tests", "megatron", "sinks_pretrain_worker.py")
ITERS, SAVE_AT, MICRO = 4, 2, 2  # MICRO: micro-batches per iteration (global batch 4 / micro 2 / DP 1)
HEADS, LAYERS = 4, 2  # MODEL_FLAGS: 4 attention heads, 2 layers
ARGS = gpt_args(ITERS, extra="--ckpt-format torch_dist") + CPU_FLAGS + ["--softmax-type", "learnable"]
SPEC = ["--spec", "megatron_ring.megatron.spec", "ring_layer_spec"]


def launch(tmp_path, name: str, tp: int, cp: int, *extra: str, replicated: bool = False, ring: bool = True):
    """One torchrun job: (per-iteration masked mean losses, TP-gathered offsets per iteration, stdout).
    ``ring=False``: Megatron's own core attention (no ``--spec``; CP = 1 only)."""
    log = tmp_path / f"{name}.sinks"
    env = {"MEGATRON_RING_LOSS_LOG": str(tmp_path / f"{name}.loss"), "MEGATRON_RING_SINKS_LOG": str(log)}
    if replicated:
        env["MEGATRON_RING_TEST_REPLICATED_SINKS"] = "1"
    p = torchrun(WORKER, tp * cp, *ARGS, *(SPEC if ring else []), "--tensor-model-parallel-size", str(tp),
                 "--context-parallel-size", str(cp), *extra, env=env, name=name)
    assert ("core attention of the layer spec: RingDotProductAttention" in p.stdout) == ring, p.stdout[-3000:]
    return masked_mean_losses(tmp_path / f"{name}.loss", MICRO), gathered_offsets(log, tp * cp, tp), p.stdout


def gathered_offsets(log, world: int, tp: int) -> list[list[list[float]]]:
    """Per iteration, per layer, every head's offset: TP ranks' heads concatenated in TP rank order, read from
    every rank's log (the replicas of one TP rank must agree, and every micro-batch of an iteration too)."""
    per_rank = [[json.loads(line) for line in open(f"{log}.rank{r}")] for r in range(world)]
    calls = len(per_rank[0])
    assert calls % MICRO == 0 and all(len(rows) == calls for rows in per_rank), [len(r) for r in per_rank]
    iterations = []
    for call in range(calls):
        by_tp: dict[int, list] = {}
        for rows in per_rank:
            tp_rank, tp_size, offsets = rows[call]
            assert tp_size == tp and len(offsets) == LAYERS, rows[call]
            assert by_tp.setdefault(tp_rank, offsets) == offsets, f"replicas of TP rank {tp_rank} disagree"
        assert sorted(by_tp) == list(range(tp)), sorted(by_tp)
        full = [sum((by_tp[t][layer] for t in range(tp)), []) for layer in range(LAYERS)]
        assert all(len(heads) == HEADS for heads in full), full
        if call % MICRO:
            assert full == iterations[-1], "the offsets changed between micro-batches of one iteration"
        else:
            iterations.append(full)
    return iterations


def check_intact(got, want) -> None:
    """Every layer's every head: the resumed run's offsets at its first step equal the saver's, exactly."""
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"layer {layer}: resumed offsets {g} != saved {w}"


def curve_ratio(got: list[float], full: list[float]) -> float:
    """The worst |resumed - uninterrupted| / bound over iterations SAVE_AT + 1 .. ITERS."""
    want = full[SAVE_AT:]
    assert len(got) == len(want) == ITERS - SAVE_AT, (got, full)
    return max(abs(a - b) / model_loss_tol(b, step=SAVE_AT + 1 + i, **MODEL_SIZES)
               for i, (a, b) in enumerate(zip(got, want)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted TP = 2 x CP = 2 run (its checkpoint at SAVE_AT is the one every resume loads)."""
    tmp = tmp_path_factory.mktemp("sinks-tp2cp2")
    ckpt = tmp / "ckpt"
    losses, offsets, _ = launch(tmp, "saver", 2, 2, "--save", str(ckpt), "--save-interval", str(SAVE_AT))
    assert len(losses) == len(offsets) == ITERS, (losses, len(offsets))
    assert (ckpt / f"iter_{SAVE_AT:07d}").is_dir(), sorted(os.listdir(ckpt))
    at_save = offsets[SAVE_AT]  # the values iteration SAVE_AT + 1 starts from: the checkpoint's
    # the check must be able to see a head lost or swapped: the saved offsets were trained (differ from the
    # initial ones) and differ between the TP ranks' halves
    assert at_save != offsets[0], offsets
    assert all(heads[:HEADS // 2] != heads[HEADS // 2:] for heads in at_save), at_save
    return ckpt, losses, at_save


@pytest.mark.parametrize("tp", [2, 1])
def test_learnable_sinks_resume_through_pretrain(tmp_path, saved, tp):
    ckpt, full, at_save = saved
    got, offsets, _ = launch(tmp_path, f"resume-tp{tp}", tp, 2, "--load", str(ckpt), "--ckpt-step",
                             str(SAVE_AT), "--exit-on-missing-checkpoint")
    check_intact(offsets[0], at_save)
    ratio = curve_ratio(got, full)
    print(f"TP={tp}: every head's offset intact; worst |resumed - uninterrupted| / bound: {ratio:.3g}")
    assert ratio <= 1, (tp, got, full[SAVE_AT:], ratio)


def test_replicated_sinks_lose_heads_through_pretrain(tmp_path):
    """The negative control: Megatron's default sharded_state_dict keeps TP rank 0's heads only."""
    ckpt = tmp_path / "ckpt"
    _, offsets, _ = launch(tmp_path, "saver", 2, 1, "--train-iters", str(SAVE_AT + 1), "--save", str(ckpt),
                           "--save-interval", str(SAVE_AT), replicated=True)
    _, loaded, _ = launch(tmp_path, "resume", 2, 1, "--train-iters", str(SAVE_AT + 1), "--load", str(ckpt),
                          "--ckpt-step", str(SAVE_AT), "--exit-on-missing-checkpoint", replicated=True)
    with pytest.raises(AssertionError, match="resumed offsets"):
        check_intact(loaded[0], offsets[SAVE_AT])
    half = HEADS // 2
    assert all(heads[half:] == heads[:half] for heads in loaded[0]), loaded[0]  # TP rank 0's heads, twice
    lost = max(abs(a - b) for g, w in zip(loaded[0], offsets[SAVE_AT]) for a, b in zip(g[half:], w[half:]))
    print(f"default sharded_state_dict: TP rank 1's heads lost (max |loaded - saved| {lost:.3g})")


def test_megatron_native_checkpoint_loads_into_ring(tmp_path):
    """The ring's sharding is Megatron's: a checkpoint written by Megatron's own DotProductAttention (TP = 2,
    CP = 1, no ring) loads into the ring model at TP = 1 x CP = 2 with every head's offset exact."""
    ckpt = tmp_path / "ckpt"
    _, offsets, _ = launch(tmp_path, "native", 2, 1, "--train-iters", str(SAVE_AT + 1), "--save", str(ckpt),
                           "--save-interval", str(SAVE_AT), ring=False)
    assert all(heads[:HEADS // 2] != heads[HEADS // 2:] for heads in offsets[SAVE_AT]), offsets[SAVE_AT]
    _, loaded, _ = launch(tmp_path, "ring", 1, 2, "--train-iters", str(SAVE_AT + 1), "--load", str(ckpt),
                          "--ckpt-step", str(SAVE_AT), "--exit-on-missing-checkpoint")
    check_intact(loaded[0], offsets[SAVE_AT])
