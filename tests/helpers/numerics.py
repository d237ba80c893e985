"""Derived tolerances for comparing attention (outputs and gradients) with the float64 reference.

The rule, derived once (docs/numerics.md, "Test tolerances"); every numerics test uses it:

    |got - ref|  <=  (eps_acc + eps_io + eps_wire) * M          (max over the compared tensor)

    M        = max |ref|, the float64 reference of the compared tensor (the whole global tensor)
    eps_acc  = STAGES * sqrt(n) * (1 + 2 * sigma) * u(fp32)
               fp32 accumulation: each of the chain's dependent reductions (forward: Q K^T, the softmax row
               sum, P V; backward: dO V^T, rowsum(dO * O), dS K / dS^T Q / P^T dO; and the ring's merge:
               STAGES = 8) has a forward error of at most ~sqrt(n) * u relative, n its length (probabilistic
               rounding-error analysis: errors of a length-n sum grow like sqrt(n), not n); an absolute
               score error delta changes the softmax weights by at most 2 * delta relative, and the score
               errors are relative to |scores| <= sigma, hence (1 + 2 * sigma).
    eps_io   = (ROUNDINGS + ROUNDINGS * sqrt(blocks)) * u(dtype)
               roundings to the compute dtype along the chain: every element sees ROUNDINGS = 2 of them
               (the kernel's cast of P or dS for its low-precision matmul, and the final cast of the output
               or gradient), and the ``blocks`` partial results of a ring (B = 2P on P ranks: zigzag's two
               half blocks per step; 1 on one process) are each rounded to the dtype (the block's output,
               and in the backward its P/dS cast again) before they are summed in fp32: B independent
               rounding errors grow like sqrt(B). The reference is fed the SAME dtype-rounded inputs, so
               input rounding is not part of the error.
    eps_wire = (1 + 2 * sigma) * u(wire)
               a lossy K/V wire rounds each visiting K and V element once, relative u(wire) (2^-8 bf16,
               2^-11 fp16, 2^-4 e4m3, 2^-3 e5m2; docs/numerics.md): V's rounding moves the output by at
               most u(wire) * M, K's moves every score by at most u(wire) * sigma and so the softmax
               weights by 2 * u(wire) * sigma relative (first order, worst case; for fp8 this is a loose
               bound: the wire's typical error is tested against its own documented bound in
               tests/test_wire_accuracy.py)

    u(dtype) = torch.finfo(dtype).eps / 2   (unit roundoff)
    n        = the longest reduction: max(keys per row, queries per key, head dim) (pass the global lengths)
    sigma    = a bound on |score| = scale * max_i |q_i| * max_j |k_j| (Cauchy-Schwarz; see score_bound)

Two runs that are each within the bound of the same reference (e.g. CP=P and CP=1, two piece counts)
differ by at most twice it: ``tol(..., runs=2)``. A wrong mask, sink, dropout decision, piece or hop gives
errors of order 0.1-1 x M, orders of magnitude above the bound (fp32: ~1e-4 x M at the suite's sizes).
"""
from __future__ import annotations

import json
import math
import os

import torch

STAGES = 8
ROUNDINGS = 2
WIRE_U = {None: 0.0, "none": 0.0, "fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11, "fp8": 2.0**-4,
          "e4m3": 2.0**-4, "fp8_e4m3": 2.0**-4, "e5m2": 2.0**-3, "fp8_e5m2": 2.0**-3}
# float64 model arithmetic (cost model, schedules: sums and products of at most ~2^10 terms, any order):
# relative error <= 2^10 * u(float64) ~ 1.1e-13
F64_REL = 2.0**10 * torch.finfo(torch.float64).eps / 2
REPORT_ENV = "MEGATRON_RING_NUMERICS_REPORT"  # a file path: worst err/tol per check appended as JSON lines


def unit_roundoff(dtype) -> float:
    """``u`` of a torch dtype (or its name): half the machine epsilon."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    return torch.finfo(dtype).eps / 2


def score_bound(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> float:
    """``sigma``: an upper bound on every |score| = scale * |q_i . k_j| (last dim = head dim)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn = q.detach().double().norm(dim=-1).max().item()
    kn = k.detach().double().norm(dim=-1).max().item()
    return scale * qn * kn


def rel_tol(*, dtype, n: int, sigma: float, wire=None, runs: int = 1, blocks: int = 1, acc=torch.float32) -> float:
    """The relative bound ``eps_acc + eps_io + eps_wire`` (times ``runs`` when two computations are compared;
    ``blocks``: 2 * P for a ring of P ranks; ``acc``: the accumulation dtype, float64 for float64 code)."""
    eps_acc = STAGES * math.sqrt(n) * (1.0 + 2.0 * sigma) * unit_roundoff(acc)
    eps_io = ROUNDINGS * (1.0 + math.sqrt(blocks)) * unit_roundoff(dtype)
    if isinstance(wire, torch.dtype):
        wire = str(wire).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
    eps_wire = (1.0 + 2.0 * sigma) * WIRE_U[wire.lower() if isinstance(wire, str) else wire]
    return runs * (eps_acc + eps_io + eps_wire)


def tol(ref_max: float, **kw) -> float:
    """Absolute bound on max |got - ref| for a tensor whose float64 reference has max |.| = ``ref_max``."""
    return rel_tol(**kw) * ref_max


def grad_terms(q, k, v, dout, scale: float | None = None, n: int = 1) -> float:
    """A bound on the terms that dq and dk are summed from, for when their reference cancels to ~0.

    dS = P * (dP - D) with |dP_ij|, |D_i| <= max|dO_i| |v_j| (norms): dS's rounding error is relative to
    2 P max|dO| max|v|, not to |dS|, which cancels to 0 when a query sees one key. dq_i = scale sum_j dS_ij k_j
    (sum_j P_ij = 1) and dk_j = scale sum_i dS_ij q_i (sum_i P_ij <= n queries) give
    ``2 * scale * max|dO| * max|v| * max(max |k_c|, n * max |q_c|)``; use ``max(max |ref|, this)`` as M."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = 2.0 * scale * dout.detach().double().norm(dim=-1).max().item() * v.detach().double().norm(dim=-1).max().item()
    return g * max(k.detach().abs().max().item(), n * q.detach().abs().max().item())


def sink_grad_scale(weight: torch.Tensor, dout: torch.Tensor, out: torch.Tensor) -> float:
    """``M`` for a learnable sink's gradient: the root-sum-square of the magnitudes of the terms it sums.

    ``dsink_h = -sum over rows of w * (dO . O)`` (``w``: the sink's softmax weight in the row,
    :func:`tests.helpers.reference.sink_weight`, ``[b, S, h]``; ``dout``, ``out`` ``[b, S, h, d_v]``, ``out`` the
    float64 reference): a signed sum over ``n = b S`` rows, which cancels (to ~0 on random data: the fp32 fuzz of
    the row tiles found a reference 600x below the sum of its terms' magnitudes). Each row's term is computed with
    a relative error, so the error scales with the terms, not with their sum: by Cauchy-Schwarz
    ``sum |t| <= sqrt(n) sqrt(sum t^2)``, and ``rel_tol``'s ``eps_acc`` already carries ``sqrt(n)``; the
    roundings of ``eps_io`` are independent per row (their sum grows like the root-sum-square). Use
    ``max(max |ref|, this)`` as ``M`` (the max over heads)."""
    terms = weight.double() * (dout.double().abs() * out.double().abs()).sum(-1)
    return terms.pow(2).sum(dim=tuple(range(terms.dim() - 1))).sqrt().max().item()


def lse_tol(lse_ref: torch.Tensor, **kw) -> float:
    """Bound on max |lse - ref| for a log-sum-exp: the relative error of the row sum becomes an absolute
    error of its log, plus lse's own relative rounding: ``rel_tol * (1 + max |lse|)``."""
    return rel_tol(**kw) * (1.0 + lse_ref.detach().abs().max().item())


def max_logit_tol(*, sigma: float, d: int, dtype=torch.float32, ref_max: float = 0.0) -> float:
    """Bound on max |max_logit - ref| (``ring_attention(..., return_max_logit=True)`` vs the float64 max of the
    same dtype-rounded inputs). Each score ``q . k`` is a length-``d`` dot product accumulated in fp32 (worst case,
    deterministic: ``(d + 1) u(fp32)`` relative to ``sum |q_i k_i| <= sigma / scale``), after casting q and k to the
    pass's dtype (exact from bf16/fp16/fp32; one rounding each, ``2 u(fp32)``, from a wider dtype), then rounded
    once to that dtype (bf16 for bf16 inputs: ``core/max_logit.score_dtype``); the row max is scaled in fp32.
    Rounding is monotone, so the max of the rounded scores is the rounding of the max, within
    ``u(score dtype) * |max|`` of it; a max of values each within delta of their float64 value is within delta
    of the float64 max. Hence ``(d + 3) u(fp32) sigma + (u(score dtype) + u(fp32)) |ref_max|``, ``ref_max`` the
    largest |reference max logit|. The wire is not part of it: the reference takes the decoded K the kernel
    sees. A max over a wrong set of pairs (masked ones, one block only) misses by a whole score gap."""
    from megatron_ring.core.max_logit import score_dtype  # noqa: PLC0415  (the pass's dtype rule)

    u32 = unit_roundoff(torch.float32)
    return (d + 3) * u32 * sigma + (unit_roundoff(score_dtype(dtype)) + u32) * abs(ref_max)


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in float64; inf when ``got`` has a NaN (so a NaN can never pass)."""
    d = (got.detach().double() - ref.detach().double()).abs()
    return float("inf") if torch.isnan(d).any() else (d.max().item() if d.numel() else 0.0)


class Checks:
    """Collects (label, err, bound) rows, asserts them all at once, and reports the worst err / bound.

    ``add`` may be called in workers (rows are plain tuples: return ``.rows`` to the parent and ``extend``).
    """

    def __init__(self, name: str):
        self.name, self.rows = name, []

    def add(self, label, err: float, bound: float) -> None:
        self.rows.append((str(label), float(err), float(bound)))

    def extend(self, rows) -> None:
        self.rows.extend(rows)

    def worst(self) -> float:
        return max((e / b if b > 0 else (0.0 if e == 0 else math.inf)) for _, e, b in self.rows)

    def worst_label(self) -> str:
        return max(self.rows, key=lambda r: r[1] / r[2] if r[2] > 0 else (0.0 if r[1] == 0 else math.inf))[0]

    def check(self, min_rows: int = 1) -> None:
        assert len(self.rows) >= min_rows, f"{self.name}: {len(self.rows)} comparisons ran, expected >= {min_rows}"
        bad = [f"{lbl}: {e:.3g} > {b:.3g}" for lbl, e, b in self.rows if not e <= b]
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"check": self.name, "rows": len(self.rows), "worst_ratio": self.worst(),
                                    "capability": torch.backends.cpu.get_cpu_capability(),
                                    "failed": len(bad), "worst": self.worst_label()}) + "\n")
        assert not bad, f"{self.name}: {len(bad)} of {len(self.rows)} over the derived bound:\n" + "\n".join(bad[:20])


# ---- model level: whole Megatron models (losses, gradients, training curves), fp32 --------------------------
# One rule for every model-level comparison in tests/megatron (docs/numerics.md, "Model-level tolerances"),
# the CP doctor's (lab/megatron_ring_lab/doctor/compare.py ``bounds``; docs/doctor.md "How the bounds are derived"):
# two runs that differ only in the order of fp32 sums (CP size, layout, comm type, resume point) differ by
#   loss (a mean of per-token values), after ``step`` optimizer updates (step = 1: the first forward):
#       |d| <= step * rel_fwd * max(|loss|, 1),      rel_fwd  = 4 eps sqrt(n_red) depth
#   a gradient tensor (sums over the iteration's n_tok tokens too), of iteration ``step``:
#       max |d| <= step * rel_grad * max |g_ref|,   rel_grad = 4 eps sqrt(n_red n_tok) depth
# eps = 2^-23 (fp32), n_red = max(seq, hidden, ffn), n_tok = tokens of one iteration, depth = layers + 2.
from megatron_ring_lab.doctor.compare import bounds as _doctor_bounds  # noqa: E402  (a tool; tests may import it)


def model_bounds(*, seq: int, hidden: int, layers: int, tokens: int, ffn: int | None = None) -> dict:
    """``rel_fwd`` / ``rel_grad`` of a model (``tokens``: per iteration, all micro-batches; ``ffn``: 4 hidden
    when not given, Megatron's default)."""
    return _doctor_bounds({"seq_length": seq, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_layers": layers,
                           "global_batch_size": max(1, tokens // seq)})


def model_loss_tol(ref_loss: float, *, step: int = 1, **sizes) -> float:
    """Bound on |loss - ref_loss| at iteration ``step`` (1-based: ``step`` - 1 updates before it)."""
    return step * model_bounds(**sizes)["rel_fwd"] * max(abs(float(ref_loss)), 1.0)


def model_curve_tols(ref_losses, **sizes) -> list[float]:
    """Per-iteration bounds for a loss curve (iteration i of the list: ``model_loss_tol(step=i + 1)``)."""
    return [model_loss_tol(x, step=i + 1, **sizes) for i, x in enumerate(ref_losses)]


def model_grad_tol(ref_grad: torch.Tensor, *, step: int = 1, **sizes) -> float:
    """Bound on max |g - g_ref| for one gradient tensor of iteration ``step``."""
    return step * model_bounds(**sizes)["rel_grad"] * ref_grad.detach().abs().max().item()


def add_model_grads(checks: "Checks", got: dict, ref: dict, *, label: str = "", step: int = 1, **sizes) -> None:
    """One row per parameter: max |got - ref| against ``model_grad_tol`` (the same names must be present)."""
    assert got.keys() == ref.keys(), (label, sorted(set(got) ^ set(ref)))
    for name, g in ref.items():
        checks.add(f"{label} {name}".strip(), max_err(got[name], g), model_grad_tol(g, step=step, **sizes))
