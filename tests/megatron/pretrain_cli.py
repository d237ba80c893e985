"""Command lines shared by the tests that launch Megatron's pretrain() with torchrun on CPU."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_ring.megatron.compat import has_megatron_training
# free_port: the launcher's helpers live in tests/helpers/launch.py (imported from here by the test files)
from tests.helpers.launch import free_port, python_cmd  # noqa: F401

#: the marks of a test that runs Megatron-LM's pretrain() (slow; needs megatron.training)
PRETRAIN_MARKS = [pytest.mark.slow,
                  pytest.mark.skipif(not has_megatron_training(),
                                     reason="megatron.training is not installed (megatron-core >= 0.19 wheel or "
                                            "a Megatron-LM checkout); CI runs this in the Python 3.12 venv")]

#: the flags that make megatron.training run on CPU/gloo through the opt-in (no fusions, no CUDA kernels), and
#: ``--num-workers 0``: the samples load in the rank itself (the same samples). Megatron's default, 2, forks two
#: DataLoader workers per data iterator from a rank that holds torch and Megatron (6 forks per rank per job here):
#: test_pretrain_loop.py + test_stock_spec.py took 109 s of machine CPU with them, 88 s without
CPU_FLAGS = ("--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion "
             "--transformer-impl local --rerun-mode disabled --no-rope-fusion --no-bias-swiglu-fusion "
             "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-persist-layer-norm --num-workers 0").split()

#: the model every model-building test uses: 2 layers, GQA 4/2, RoPE, 64 tokens
MODEL_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
               "--num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope "
               "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
               "--hidden-dropout 0 --vocab-size 128 --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer "
               "--seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000").split()

#: MODEL_FLAGS' sizes for the model-level tolerance (tests/helpers/numerics.py ``model_bounds``): FFN 128 (Megatron's
#: SwiGLU default, int(4 h 2/3 / 64) 64), a global batch of 4 sequences per iteration (``gpt_args``)
MODEL_SIZES = dict(seq=64, hidden=64, layers=2, ffn=128, tokens=4 * 64)


def gpt_args(iters: int, *, attention_dropout: float = 0.0, extra: str = "") -> list[str]:
    """The model, a 2 x 2 micro-batch schedule and AdamW with a cosine schedule, for ``iters`` iterations."""
    return MODEL_FLAGS + (f"--micro-batch-size 2 --global-batch-size 4 --train-iters {iters} --lr 3e-3 "
                          "--min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 "
                          f"--clip-grad 1.0 --attention-dropout {attention_dropout:g} {extra}").split()



#: the repository root (PYTHONPATH of launched commands)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_doctor(tmp_path, cache, script: str, script_args, *doctor_args: str, env_extra: dict | None = None,
               timeout: float | None = None) -> tuple[int, dict, str]:
    """``python -m megatron_ring_lab.doctor --cp 2 --iters 2 ... -- script script_args``: (exit code, its --json
    record (empty if none was written), stdout + the tail of stderr)."""
    out = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = python_cmd("-m", "megatron_ring_lab.doctor", "--cp", "2", "--iters", "2", "--json", str(out), "--cache",
                     str(cache), "--workdir", str(tmp_path / "runs"), *doctor_args, "--", script, *script_args)
    timeout = timeout if timeout is not None else float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "600"))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(out.read_text()) if out.exists() else {}
    return p.returncode, data, p.stdout + p.stderr[-3000:]
