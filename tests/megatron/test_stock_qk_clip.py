"""``--qk-clip --qk-clip-threshold T --log-max-attention-logit`` through the CI mirror of Megatron-LM's
``pretrain_gpt.py`` (tests/megatron/stock_pretrain_gpt.py, megatron.training of the 0.19 wheel), one ``--spec`` line,
at CP = 1, 2 and 4.

Megatron's argument check asks for TransformerEngine >= 2.9 with these flags; on CPU the opt-in answers it for
the ring's spec (``compat.qk_clip_te_check``): without that answer none of these runs starts. Megatron's own
``train_step`` calls ``clip_qk`` after each optimizer step: it MAX-reduces every layer's
``current_max_attn_logits`` over DP x CP, clips the Q/K weights of the heads above T and returns the max it logs.
Megatron's ``clip_qk`` walks ``model_chunk.module.module`` (DDP, then the fp16/bf16 wrapper), so these runs are
``--bf16`` (in fp32 Megatron's own ``clip_qk`` raises AttributeError whatever the attention). Checked: every run
starts, trains ITERS iterations and logs a finite max logit per iteration; T is below the first iteration's max
(heads clip at once); and the clip acts: the same run logging only (no ``--qk-clip``) trains differently (CPU runs
are deterministic, so without a clip the two would be bit-identical). CP > 1 vs CP = 1 in fp32 (exact within the
derived model-level rule) is tests/megatron/test_qk_clip.py (Megatron's ``clip_qk`` on the ring spec's model); the
bf16 differences of these runs are printed (no derived bf16 model-level rule exists in tests/helpers/numerics.py).
"""
from __future__ import annotations

import math

import pytest

from tests.helpers.launch import masked_mean_losses, torchrun
from tests.megatron.test_stock_spec import ITERS, MICRO, MODEL, SCRIPT, SPEC, _has_builder

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _has_builder(), reason="needs megatron.training with "
                                                   "GPTModelBuilder (megatron-core >= 0.19 wheel)")]

THRESHOLD = 0.1  # the first iteration's max logit of this model is ~0.12
QK = ["--qk-clip", "--qk-clip-threshold", str(THRESHOLD), "--log-max-attention-logit", "--bf16"]


def _launch(tmp_path, name: str, cp: int, *flags: str) -> tuple[list[float], list[float]]:
    loss, logit = tmp_path / f"{name}.loss", tmp_path / f"{name}.logit"
    torchrun(SCRIPT, cp, *MODEL, "--context-parallel-size", str(cp), *SPEC, *flags,
             env={"MEGATRON_RING_LOSS_LOG": str(loss), "MEGATRON_RING_MAX_LOGIT_LOG": str(logit)}, name=name)
    losses = masked_mean_losses(loss, MICRO)
    logits = [float(x) for x in logit.read_text().split()]
    assert len(losses) == len(logits) == ITERS and all(map(math.isfinite, losses + logits)), (losses, logits)
    return losses, logits


def test_stock_qk_clip_runs_at_every_cp_and_clips(tmp_path):
    runs = {cp: _launch(tmp_path, f"qk-cp{cp}", cp, *QK) for cp in (1, 2, 4)}
    assert all(run[1][0] > THRESHOLD for run in runs.values()), runs  # heads clip in the first iteration
    log_only = _launch(tmp_path, "log-only-cp2", 2, "--log-max-attention-logit", "--bf16")
    assert log_only[0][0] == runs[2][0][0]  # the same first forward (the clip comes after it) ...
    assert log_only[0][1:] != runs[2][0][1:]  # ... then the clip changed the weights
    print("\ncp | iteration | loss | max logit | |loss - cp1| | |max logit - cp1|")
    for cp, (losses, logits) in runs.items():
        for i in range(ITERS):
            print(f"{cp} | {i + 1} | {losses[i]:.7f} | {logits[i]:.7f} | {abs(losses[i] - runs[1][0][i]):.2e} | "
                  f"{abs(logits[i] - runs[1][1][i]):.2e}")
