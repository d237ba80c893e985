"""Megatron's own hybrid-CP loop with the ring: exact against fixed CP and CP = 1 (issue 21 point 2).

megatron-core 0.19's ``pretrain()`` (examples/pretrain_ring_gpt.py) with ``--hybrid-context-parallel
--calculate-per-token-loss`` on 4 CPU ranks (DP 2 x CP 2 = 4): Megatron's sampler, data wrapper,
``BalancedCPScheduler`` and ``hybrid_context_parallel_forward_backward`` run each document of the global
batch on a group of 1, 2 or 4 ranks; ring attention takes the group from ``packed_seq_params``. A second
hybrid run swaps our ``RingCPScheduler`` in at Megatron's seam (``--ring-cp-scheduler``).

How the comparison is made: the same 8 samples of 64 tokens (three documents each, lengths multiples of 8,
from the seeded dataset) form one global batch; the same seed gives the same initial weights (checked);
two iterations of plain SGD (lr 0.1, no weight decay, no clipping, constant lr). References, same script:

* fixed CP = 2 x DP = 2 (``--documents``): each sample one packed THD stream on the fixed CP group, ring
  attention within documents, RoPE per document;
* CP = 1, one process (``--documents``): each document its own causal sequence through Megatron's local
  attention (independent of the ring).

Compared per iteration: the per-token loss SUM over the global batch (every rank logs its own tokens'
sum; the files are summed) and the token count; the weights at the start of iteration 1 and
2 (after one step), and the gradient of step 1 as (w1 - w0) / lr. Tolerances (fp32): the model-level rule of
tests/helpers/numerics.py: loss sums of iteration i within ``i rel_fwd |sum|``, each gradient tensor within
``rel_grad max |g_ref|`` plus the resolution of (w1 - w0) / lr: each run's fp32 w1 is rounded once
(``u(fp32) |w1|``), so two runs' (w1 - w0) / lr differ by at most another ``2 u(fp32) max |w1| / lr``.
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

from tests.helpers.launch import ROOT, torchrun
from tests.helpers.numerics import Checks, max_err, model_grad_tol, model_loss_tol, unit_roundoff
from tests.megatron.pretrain_cli import PRETRAIN_MARKS, CPU_FLAGS


pytestmark = PRETRAIN_MARKS

SCRIPT = os.path.join(ROOT, "examples", "pretrain_ring_gpt.py")
LR = 0.1
ITERS = 2
TOKENS = 8 * 64  # global batch 8 samples x 64 tokens
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 "
         f"--train-iters {ITERS} --optimizer sgd --lr {LR} --lr-decay-style constant --weight-decay 0 --clip-grad 0 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --vocab-size 128 "
         "--make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer --seed 1234 --log-interval 1 "
         "--eval-iters 0 --eval-interval 1000 --calculate-per-token-loss").split()
CPU = CPU_FLAGS
RUNS = {  # name: (processes, flags)
    "cp1": (1, "--documents"),
    "cp2": (4, "--context-parallel-size 2 --documents"),
    # cap 16 tokens per rank: documents of 8-16 tokens run alone, 24-32 on 2 ranks, 40-48 on 4
    "hybrid": (4, "--context-parallel-size 2 --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 16"),
    # the same loop with our scheduler at Megatron's seam (RingCPScheduler instead of BalancedCPScheduler)
    "hybrid-ours": (4, "--context-parallel-size 2 --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 16 "
                       "--ring-cp-scheduler"),
}
#: the model-level rule's sizes: FFN 128 (Megatron's SwiGLU default for hidden 64), TOKENS per iteration
SIZES = dict(seq=64, hidden=64, layers=2, ffn=128, tokens=TOKENS)



def _launch(tmp_path, name: str) -> dict:
    import torch

    nproc, flags = RUNS[name]
    log, dump = tmp_path / f"{name}.loss", tmp_path / f"{name}.w"
    p = torchrun(SCRIPT, nproc, *MODEL, *CPU, *flags.split(), name=name,
                 env={"MEGATRON_RING_LOSS_LOG": str(log), "MEGATRON_RING_WEIGHTS_DUMP": str(dump)})
    assert f"iteration        {ITERS}/" in p.stdout, "Megatron's own per-iteration log is missing"
    loss, tokens, sizes = defaultdict(float), defaultdict(float), set()
    for rank in range(nproc):
        for line in (tmp_path / f"{name}.loss.rank{rank}").read_text().splitlines():
            it, l, t, g = line.split()
            loss[int(it)] += float(l)
            tokens[int(it)] += float(t)
            sizes.add(int(g))
    weights = [torch.load(f"{dump}.it{k}.pt") for k in range(ITERS)]
    return {"loss": dict(loss), "tokens": dict(tokens), "sizes": sizes, "weights": weights, "stdout": p.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    return {name: _launch(tmp, name) for name in RUNS}


def _grads(run) -> dict:
    w0, w1 = run["weights"]
    return {n: (w0[n] - w1[n]) / LR for n in w0}


def test_reference_is_meaningful(runs):
    ref = runs["cp1"]
    assert ref["tokens"] == {it: TOKENS for it in range(ITERS)}, ref["tokens"]
    assert ref["loss"][1] < ref["loss"][0], f"the step must lower the loss: {ref['loss']}"
    assert max(g.abs().max().item() for g in _grads(ref).values()) > 1e-2, "gradients too small to compare"


@pytest.mark.parametrize("name", ["cp2", "hybrid", "hybrid-ours"])
def test_matches_cp1(runs, name):
    ref, got = runs["cp1"], runs[name]
    assert got["tokens"] == ref["tokens"], (name, got["tokens"])
    c = Checks(f"hybrid-CP loop {name} vs CP=1")
    for it in range(ITERS):
        c.add(f"loss sum {it}", abs(got["loss"][it] - ref["loss"][it]), model_loss_tol(ref["loss"][it], step=it + 1, **SIZES))
    w0, r0 = got["weights"][0], ref["weights"][0]
    assert w0.keys() == r0.keys()
    for n in r0:  # same seed, same initial weights: the precondition of the comparison
        assert w0[n].equal(r0[n]), f"{name}: initial weights differ in {n}"
    g, rg, w1 = _grads(got), _grads(ref), ref["weights"][1]
    for n in rg:
        resolution = 2 * unit_roundoff(torch.float32) * w1[n].abs().max().item() / LR
        c.add(f"step-1 gradient {n}", max_err(g[n], rg[n]), model_grad_tol(rg[n], **SIZES) + resolution)
    c.check(min_rows=ITERS + len(rg))


def test_hybrid_ran_documents_on_groups_of_1_2_and_4(runs):
    for name in ("hybrid", "hybrid-ours"):
        assert runs[name]["sizes"] == {1, 2, 4}, (name, runs[name]["sizes"])
    assert runs["cp2"]["sizes"] == {2}, runs["cp2"]["sizes"]
    assert "[ring-cp-scheduler]" in runs["hybrid-ours"]["stdout"], "our scheduler was not swapped in"
    assert "[ring-cp-scheduler]" not in runs["hybrid"]["stdout"]
