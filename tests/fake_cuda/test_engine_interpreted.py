"""The whole engine on its CUDA code path with its Triton kernels run in Triton's interpreter, on CPU tensors,
against the float64 reference: outputs and gradients of every rank. The merge and the list op in every case; the
fused attention dropout kernels (kernels/dropout_triton.py) in the dropout cases.

The kernels' own tests (test_triton_kernels.py) check each kernel against its torch reference on chosen tensors;
here they run as the engine calls them, on the tensors it hands them: row-slice views of the accumulators, the
visiting block's status rider, fresh merges, K/V written into the wire slots with their status zeroed, every
gradient add of a backward step gathered into list ops, the results converted to the caller's dtype. How: the
fake CUDA device (tests/helpers/fake_device.py) gives the engine its CUDA flow (status read in the backward), the
backward gathers its adds as on CUDA (``launch.gathers_adds``), and the merge and the list op take their direct
Triton route (``launch.route``), interpreted (``TRITON_INTERPRET=1``). Each rank is a thread of one ThreadRing;
the interpreter patches ``triton.language`` while a kernel runs, so launches are serialised by a lock.

Negative controls: a list op whose adds copy instead, a merge that takes every block as the first one, and
dropout kernels keyed on another seed, each fail the comparison (the kernels are on the path, and the check can
fail)."""
from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

# the merge computes 1 / total and log(total) for every row and keeps 0 and -inf where a row sees no key (a padding
# token): numpy, which runs the interpreted kernel, warns about the division and the log of 0 it was told to do
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

from megatron_ring import DocumentZigzag, device, ring_attention  # noqa: E402
from megatron_ring.core import engine, foreach, foreach_triton, launch, merge, merge_triton, plan  # noqa: E402
from megatron_ring.kernels import dropout_triton  # noqa: E402
from megatron_ring.kernels.dropout import FusedDropoutKernel  # noqa: E402
from megatron_ring.schedules.layouts import get_layout  # noqa: E402
from tests.helpers.fake_device import FakeCuda  # noqa: E402
from tests.helpers.numerics import max_err, score_bound, tol  # noqa: E402
from tests.helpers.reference import feature_reference, outputs_and_grads  # noqa: E402
from tests.helpers.ring_fakes import run_threads  # noqa: E402
from tests.helpers.triton_interp import loops_interpreted  # noqa: E402

# (P, layout, causal, heads (h, h_kv), head dims (qk, v), dtype, format, extra ring_attention arguments)
CASES = {
    "causal-gqa-pieces": (2, "zigzag", True, (4, 2), (16, 16), torch.float32, "bshd", dict(kv_pieces=2)),
    "full-bf16-wire": (3, "striped", False, (2, 2), (16, 16), torch.bfloat16, "sbhd", dict(comm_dtype="bf16")),
    "documents-padding": (2, "zigzag", True, (2, 1), (16, 16), torch.float32, "thd",
                          dict(cu_seqlens=[0, 5, 9, 20, 22])),
    "mla-window": (3, "contiguous", True, (2, 2), (16, 8), torch.float32, "bshd", dict(window=(5, 0))),
    # attention dropout on its fused kernels (kernels/dropout_triton.py), interpreted: fp16, as Triton's interpreter
    # computes no bf16 products (numpy has no bf16); whole blocks and masked tiles, an int seed and a tensor seed
    "dropout-documents": (2, "zigzag", True, (4, 2), (16, 16), torch.float16, "thd",
                          dict(cu_seqlens=[0, 5, 9, 20, 22], dropout_p=0.25, dropout_seed=7)),
    "dropout-mla-window": (3, "striped", True, (2, 1), (16, 8), torch.float16, "bshd",
                           dict(window=(5, 0), dropout_p=0.3, dropout_seed=torch.tensor(2 ** 40 + 99))),
    "dropout-full-gqa": (2, "zigzag", False, (4, 1), (32, 32), torch.float16, "sbhd",
                         dict(dropout_p=0.1, dropout_seed=3)),
    # Megatron's per-document zigzag (documents padded to multiples of 2P, each filler a document of its own): a
    # block of many runs of rows, one task per ring step on the fused dropout kernels
    "dropout-doc-zigzag": (2, DocumentZigzag([0, 8, 12, 24]), True, (2, 1), (16, 16), torch.float16, "thd",
                           dict(cu_seqlens=[0, 6, 8, 12, 21, 24], dropout_p=0.2, dropout_seed=11)),
}


@pytest.fixture
def interpreted(monkeypatch):
    """The CUDA path's fused ops on CPU tensors, their Triton kernels interpreted, one launch at a time."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    merge_triton._kernel.cache_clear()
    foreach_triton._kernel.cache_clear()
    dropout_triton._kernels.cache_clear()
    lock = threading.Lock()

    def locked(fn):
        def run(*args, **kw):
            with lock:
                return fn(*args, **kw)
        return run

    monkeypatch.setattr(merge, "merge_triton", locked(merge.merge_triton))
    monkeypatch.setattr(foreach, "foreach_triton", locked(foreach.foreach_triton))
    for name in ("dropout_attention_forward", "dropout_attention_backward"):
        monkeypatch.setattr(dropout_triton, name, locked(getattr(dropout_triton, name)))
    monkeypatch.setattr(plan, "fused_dropout", lambda device: True)  # chosen on CUDA only: these tensors are CPU ones
    monkeypatch.setattr(merge, "route", lambda *t: launch.DIRECT)
    monkeypatch.setattr(foreach, "route", lambda *t: launch.DIRECT)
    monkeypatch.setattr(engine, "gathers_adds", lambda t: True)
    with device.use("cpu", FakeCuda()):
        yield
    merge_triton._kernel.cache_clear()
    foreach_triton._kernel.cache_clear()
    dropout_triton._kernels.cache_clear()


def _errors(name: str) -> list[tuple[str, float, float]]:
    """Per rank and tensor: (what, max error vs the float64 reference, the derived bound)."""
    P, layout, causal, (h, h_kv), (dqk, dv), dtype, fmt, extra = CASES[name]
    S = 12 * P
    g = torch.Generator().manual_seed(P)
    q = torch.randn(1, S, h, dqk, generator=g).to(dtype)
    k = torch.randn(1, S, h_kv, dqk, generator=g).to(dtype)
    v = torch.randn(1, S, h_kv, dv, generator=g).to(dtype)
    dout = torch.randn(1, S, h, dv, generator=g).to(dtype)
    cu = extra.get("cu_seqlens")
    kw = dict(extra, cu_seqlens=torch.tensor(cu, dtype=torch.int32)) if cu else dict(extra)
    seed = extra.get("dropout_seed")
    drop = {} if seed is None else dict(dropout_p=extra["dropout_p"], seed=int(seed))
    ref = outputs_and_grads(lambda *t: feature_reference(*t, causal=causal, cu=cu, window=extra.get("window"), **drop),
                            q.double(), k.double(), v.double(), dout.double())
    pos = [get_layout(layout).positions(S, P, r) for r in range(P)]
    fmt_in = {"bshd": lambda t: t, "sbhd": lambda t: t.transpose(0, 1).contiguous(), "thd": lambda t: t[0]}[fmt]
    fmt_out = {"bshd": lambda t: t, "sbhd": lambda t: t.transpose(0, 1), "thd": lambda t: t.unsqueeze(0)}[fmt]

    def rank(r, ring):
        leaves = [fmt_in(t[:, pos[r]]).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, causal=causal, layout=layout, qkv_format=fmt, ring=ring, **kw)
        out.backward(fmt_in(dout[:, pos[r]]))
        return [fmt_out(t) for t in (out.detach(), *(x.grad for x in leaves))]

    results = run_threads(rank, P)
    sigma = score_bound(q, k)
    errors = []
    for r, got in enumerate(results):
        if isinstance(got, BaseException):
            raise got
        for what, a, want in zip(("out", "dq", "dk", "dv"), got, ref):
            errors.append((f"rank {r} {what}", max_err(a, want[:, pos[r]]),
                           tol(want.abs().max().item(), dtype=dtype, n=max(S, dqk), sigma=sigma, blocks=2 * P,
                               wire=extra.get("comm_dtype"))))
    return errors


def _runs_here(name: str):
    """A dropout case needs loops with runtime bounds in the interpreter (tests/helpers/triton_interp.py)."""
    skip = name.startswith("dropout") and not loops_interpreted()
    return pytest.param(name, marks=pytest.mark.skipif(skip, reason="this Triton's interpreter runs no loop with a "
                                                                    "runtime bound"))


@pytest.mark.parametrize("name", [_runs_here(n) for n in CASES])
def test_the_engine_with_its_kernels_interpreted_matches_float64(interpreted, name):
    bad = [e for e in _errors(name) if not e[1] <= e[2]]
    assert not bad, bad


def test_a_list_op_that_copies_instead_of_adding_fails(interpreted, monkeypatch):
    launch_ = foreach.foreach_triton

    def copies(dsts, srcs, modes):
        return launch_(dsts, srcs, [foreach_triton.COPY if m == foreach_triton.ADD else m for m in modes])

    monkeypatch.setattr(foreach, "foreach_triton", copies)
    bad = [e for e in _errors("causal-gqa-pieces") if not e[1] <= e[2]]
    assert bad and all(what.split()[-1] != "out" for what, _, _ in bad), bad  # gradients wrong, outputs not


def test_a_merge_that_takes_every_block_as_the_first_fails(interpreted, monkeypatch):
    launch_ = merge.merge_triton
    monkeypatch.setattr(merge, "merge_triton", lambda acc, lse, o, l, fresh, *a, **kw: launch_(acc, lse, o, l, True,
                                                                                              *a, **kw))
    bad = [e for e in _errors("causal-gqa-pieces") if not e[1] <= e[2]]
    assert any(what.endswith("out") for what, _, _ in bad), bad


@pytest.mark.skipif(not loops_interpreted(), reason="this Triton's interpreter runs no loop with a runtime bound")
@pytest.mark.parametrize("whole", [True, False])
def test_megatron_per_document_zigzag_with_dropout_runs_one_launch_per_ring_step(interpreted, monkeypatch, whole):
    """On the fused dropout kernels a block of Megatron's per-document zigzag (two runs of rows per document) is ONE
    task: one forward launch per ring step and rank, P x P in all, within the float64 bound. Negative control
    (``whole=False``): a schedule that cuts the block into its runs of rows launches many more, same results."""
    launches = []
    forward = dropout_triton.dropout_attention_forward

    def counted(*a, **kw):
        launches.append(1)
        return forward(*a, **kw)

    monkeypatch.setattr(dropout_triton, "dropout_attention_forward", counted)
    if not whole:
        monkeypatch.setattr(FusedDropoutKernel, "one_task", staticmethod(lambda mask: False))
    bad = [e for e in _errors("dropout-doc-zigzag") if not e[1] <= e[2]]
    assert not bad, bad
    P = CASES["dropout-doc-zigzag"][0]
    assert (len(launches) == P * P) == whole, len(launches)


@pytest.mark.skipif(not loops_interpreted(), reason="this Triton's interpreter runs no loop with a runtime bound")
def test_a_dropout_kernel_keyed_on_another_seed_fails(interpreted, monkeypatch):
    """Negative control of the dropout cases: the fused kernels fed a seed one off (another keep mask) miss the
    float64 reference of the call's own seed."""
    args = FusedDropoutKernel._args

    def other_seed(self, *a):
        got = list(args(self, *a))
        got[7] += 1  # seed_int (the cases' int seed)
        return tuple(got)

    monkeypatch.setattr(FusedDropoutKernel, "_args", other_seed)
    bad = [e for e in _errors("dropout-full-gqa") if not e[1] <= e[2]]
    assert any(what.endswith("out") for what, _, _ in bad), bad
