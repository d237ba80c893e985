"""``--spec megatron_ring.megatron.spec ring_hybrid_stack_spec`` through Megatron's own ``pretrain()`` (0.19 wheel).

tests/megatron/stock_pretrain_hybrid.py builds the run the way Megatron-LM's ``pretrain_hybrid.py`` does
(``hybrid_config_from_args`` imports ``--spec`` as the hybrid stack spec; ``HybridModelBuilder``; Megatron's
own zigzag batch split, RoPE and loss): nothing from megatron_ring is called except through ``--spec`` (and
the CPU opt-in). Reference: the same script at CP=1 with ``reference_hybrid_stack_spec`` (the same stack
with Megatron's own attention; megatron-core's TransformerEngine spec cannot be built without TE), one
process. Per-iteration masked mean loss, fp32: CP=2 equals CP=1 within the model-level bound ``i rel_fwd max(|loss|, 1)`` at iteration i
(tests/helpers/numerics.py; 4 layers, FFN 128, 4 x 64 tokens per iteration) (pattern ``M*M-``: Mamba
layers through Megatron's own CP, the attention layer on the ring). The control (the reference spec at
CP=2) is refused by Megatron; a ``D`` layer is refused by name.

Packed THD (the mirror follows stock ``get_batch``'s packed path, ``--sft`` and
``--dataloader-inter-document-masking``): the reference is the ring at CP=1 (one rank: the documents as a mask; Megatron's local attention refuses packed
sequences). ``--sft`` (documents padded to 2 x CP, split per document; ``M*M-`` with RoPE: Mamba layers
undo that order through Megatron's own CP; with ``--calculate-per-token-loss``: the loss-masked filler leaves the CP
ranks different token counts, and Megatron's default divides each rank's loss by its own count, which no CP
attention can make equal to CP=1, docs/doctor.md) and ``--dataloader-inter-document-masking`` (unpadded documents, the
stream split as one sequence; ``*-*-`` without RoPE) at CP=2 equal CP=1 within the same bound. The negative
control splits the ``--sft`` batch the other way (``MEGATRON_RING_TEST_MISSPLIT``): the comparison fails. The
stream split with Mamba layers is refused by name at build time.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch
from tests.helpers.launch import torchrun_cmd, torchrun_env
from tests.helpers.numerics import Checks, add_model_grads, model_curve_tols
from tests.megatron.pretrain_cli import CPU_FLAGS, MODEL_SIZES

from megatron_ring.megatron.compat import has_megatron_training

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not has_megatron_training(), reason="needs megatron.training (0.19 wheel)")]
pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel ships with megatron-core >= 0.19")
pytest.importorskip("einops", reason="Megatron's Mamba layers import einops (pinned; scripts/setup_env.sh)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "stock_pretrain_hybrid.py")
ITERS, MICRO = 3, 2
MODEL = ("--hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--seq-length 64 --max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm "
         "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 "
         "--attention-dropout 0 --vocab-size 128 --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer "
         "--seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000 --mamba-state-dim 16 "
         "--mamba-head-dim 16 --mamba-num-groups 2 --micro-batch-size 2 --global-batch-size 4 "
         f"--train-iters {ITERS} --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1 "
         "--weight-decay 0.01 --clip-grad 1.0").split() + CPU_FLAGS
RING = ["--spec", "megatron_ring.megatron.spec", "ring_hybrid_stack_spec"]
REFERENCE = ["--spec", "megatron_ring.megatron.spec.hybrid", "reference_hybrid_stack_spec"]
TIMEOUT = float(os.environ.get("MEGATRON_RING_TEST_TIMEOUT", "240"))


def launch(tmp_path, name: str, nproc: int, pattern: str, *extra: str, ok: bool = True, model: list | None = None,
           env_extra: dict | None = None):
    log = tmp_path / f"{name}.loss"
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)  # keep where einops is
    env = torchrun_env(dict(MEGATRON_RING_LOSS_LOG=str(log), MEGATRON_RING_GRAD_LOG=str(tmp_path / f"{name}.grads"),
                            PYTHONPATH=path, **(env_extra or {})))
    cmd = torchrun_cmd(SCRIPT, nproc, *(MODEL if model is None else model), "--hybrid-layer-pattern", pattern,
                       "--context-parallel-size", str(nproc), *extra)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if not ok:
        assert p.returncode != 0, f"{name} should have failed:\n{p.stdout[-2000:]}"
        return p.stdout + p.stderr
    assert p.returncode == 0, f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    rows = [tuple(map(float, line.split()[:2])) for line in log.read_text().splitlines()]
    assert len(rows) == ITERS * MICRO, rows
    losses = [sum(r[0] for r in rows[i:i + MICRO]) / sum(r[1] for r in rows[i:i + MICRO])
              for i in range(0, len(rows), MICRO)]
    return losses, p.stdout


def test_stock_pretrain_hybrid_cp2_equals_cp1(tmp_path):
    ref, out = launch(tmp_path, "cp1", 1, "M*M-", *REFERENCE)
    assert ref[-1] < ref[0], f"the reference must train: {ref}"
    assert "ring attention in" not in out
    got, out = launch(tmp_path, "cp2", 2, "M*M-", *RING)
    assert "ring attention in layers 2 (*) of 4 (pattern M*M-)" in out, out[-3000:]
    compare("stock pretrain_hybrid CP=2 vs CP=1", got, ref, "M*M-", grads(tmp_path, "cp2"), grads(tmp_path, "cp1"))


def grads(tmp_path, name: str) -> dict:
    """The first step's final gradients the run saved (tests/megatron/stock_pretrain_gpt.py)."""
    return torch.load(tmp_path / f"{name}.grads")


def compare(name: str, got: list, ref: list, pattern: str, got_grads: dict | None = None,
            ref_grads: dict | None = None) -> None:
    """Loss per iteration, and where given the first step's gradients, against the model-level bounds."""
    sizes = dict(MODEL_SIZES, layers=len(pattern))  # one layer per pattern character
    c = Checks(name)
    for i, (a, b, t) in enumerate(zip(got, ref, model_curve_tols(ref, **sizes))):
        c.add(f"iteration {i + 1}", abs(a - b), t)
    if ref_grads is not None:
        add_model_grads(c, got_grads, ref_grads, label="step-1 grad", step=1, **sizes)
    c.check(min_rows=ITERS + (len(ref_grads) if ref_grads else 0))


#: packed THD: how stock get_batch splits (per document: --sft; one sequence: --dataloader-inter-document-masking)
PACKED = {"sft": ("M*M-", ["--sft", "--calculate-per-token-loss"]),  # filler is loss-masked: see below
          "inter-document": ("*-*-", ["--dataloader-inter-document-masking", "--position-embedding-type", "none"])}


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory):
    """The CP=1 loss curve per packed mode (the ring on one rank), computed once per module."""
    cache: dict = {}

    def get(mode: str) -> tuple[list, dict]:
        if mode not in cache:
            pattern, flags = PACKED[mode]
            where = tmp_path_factory.mktemp(f"ref-{mode}")
            ref, _ = launch(where, "cp1", 1, pattern, *RING, *flags)
            assert ref[-1] < ref[0], f"the reference must train: {ref}"
            cache[mode] = (ref, grads(where, "cp1"))
        return cache[mode]
    return get


@pytest.mark.parametrize("mode", sorted(PACKED))
def test_stock_pretrain_hybrid_packed_thd_cp2_equals_cp1(tmp_path, packed_reference, mode):
    pattern, flags = PACKED[mode]
    ref, ref_grads = packed_reference(mode)
    got, _ = launch(tmp_path, "cp2", 2, pattern, *RING, *flags)
    compare(f"stock pretrain_hybrid packed THD ({mode}) CP=2 vs CP=1", got, ref, pattern, grads(tmp_path, "cp2"),
            ref_grads)


def test_stock_packed_thd_missplit_fails_the_comparison(tmp_path, packed_reference):
    """Negative control: the --sft batch split as one sequence (tokens in another order than the arguments
    announce) runs, but the comparison catches it."""
    pattern, flags = PACKED["sft"]
    got, _ = launch(tmp_path, "missplit", 2, pattern, *RING, *flags, env_extra={"MEGATRON_RING_TEST_MISSPLIT": "1"})
    ref, ref_grads = packed_reference("sft")
    with pytest.raises(AssertionError, match="step-1 grad"):
        compare("mis-split", got, ref, pattern, grads(tmp_path, "missplit"), ref_grads)


def test_stock_packed_stream_split_with_mamba_refused(tmp_path):
    out = launch(tmp_path, "stream-mamba", 2, "M*M-", *RING, "--dataloader-inter-document-masking", ok=False)
    assert "--dataloader-inter-document-masking at CP=2 with hybrid layer(s) M" in out, out[-3000:]
    assert "--sft" in out


def test_stock_control_and_dsa_refused(tmp_path):
    out = launch(tmp_path, "control", 2, "M*M-", *REFERENCE, ok=False)
    assert "Context parallelism is only supported by TEDotProductAttention" in out, out[-3000:]
    no_gqa = [a for a in MODEL if a not in ("--group-query-attention",)]  # D layers are MLA: no GQA flags
    no_gqa = [a for i, a in enumerate(no_gqa) if a != "--num-query-groups" and no_gqa[i - 1] != "--num-query-groups"]
    out = launch(tmp_path, "dsa", 1, "MD-", *RING, ok=False, model=no_gqa)
    assert "hybrid layer 'D'" in out, out[-3000:]
