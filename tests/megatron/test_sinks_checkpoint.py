"""Learnable attention sinks survive Megatron's distributed checkpointing at TP = 2 x CP = 2.

``RingDotProductAttention.sharded_state_dict`` shards the learnable ``softmax_offset`` (``[heads / tp]`` per TP
rank) over TP, as Megatron's ``DotProductAttention`` does. tests/megatron/sinks_ckpt_worker.py (4 processes,
torchrun) builds a ring-attention GPT with ``softmax_type="learnable"`` at TP = 2 x CP = 2, gives every head of
every layer a distinct offset, saves a ``torch_dist`` checkpoint, and loads it into fresh models at TP = 2
(each rank must get its own heads) and at TP = 1 (every rank must get every head).

Negative control: saved by ``MegatronModule``'s default (the offset treated as replicated over TP), TP rank 1's
heads are lost: the TP = 2 load gives TP rank 1 rank 0's heads, or the TP = 1 load fails.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from tests.helpers.launch import torchrun_cmd, torchrun_env

pytestmark = [pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron", "sinks_ckpt_worker.py")
HEADS, LAYERS, TP = 4, 2, 2
TIMEOUT = float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "400"))


def expected(layer: int, heads) -> list[float]:
    return [10.0 * layer + g + 0.5 for g in heads]


def _run(tmp_path, mode: str) -> dict:
    out = tmp_path / f"{mode}.json"
    cmd = torchrun_cmd(WORKER, 4, str(tmp_path / f"ckpt-{mode}"), mode, str(out))
    p = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, f"{mode} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(out.read_text())


def _intact(result: dict) -> None:
    per = HEADS // TP
    tp2, tp1 = result["tp2"], result["tp1"]
    assert isinstance(tp2, list), tp2
    for offsets, tp_rank in tp2:  # every rank: its own heads, every layer
        assert offsets == [expected(layer, range(tp_rank * per, (tp_rank + 1) * per)) for layer in range(LAYERS)], \
            (tp_rank, offsets)
    assert isinstance(tp1, list), tp1
    for offsets, _ in tp1:  # every rank: every head
        assert offsets == [expected(layer, range(HEADS)) for layer in range(LAYERS)], offsets


def test_learnable_sinks_saved_at_tp2_cp2_load_at_tp2_and_tp1(tmp_path):
    _intact(_run(tmp_path, "ring"))


def test_replicated_sinks_lose_heads(tmp_path):
    """The negative control: the check above fails on the state dict Megatron's default would write."""
    with pytest.raises(AssertionError):
        _intact(_run(tmp_path, "replicated"))
