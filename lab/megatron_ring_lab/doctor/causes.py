"""Likely causes of a difference between CP=1 and CP=k, from what the comparison found (first match first).

Each cause has a signature over the comparison's facts, a name, and what to check. Issue numbers are those
of reports with the same symptom (MLM = NVIDIA/Megatron-LM).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron_ring_lab.doctor.compare import Comparison


@dataclass(frozen=True)
class Cause:
    key: str
    name: str
    explain: str
    refs: str = ""


def _mtp_worst(c: Comparison, ctx: dict) -> bool:
    bad = c.facts.get("grad_bad", [])
    return bool(ctx.get("mtp")) and bool(bad) and "mtp" in bad[0][0]


def _router_worst(c: Comparison, ctx: dict) -> bool:
    bad = c.facts.get("grad_bad", [])
    return bool(ctx.get("moe")) and bool(bad) and "router" in bad[0][0]


def _grads_only(c: Comparison) -> bool:
    """Gradients differ while the data, the forward pass and the token counts agree."""
    rows = {r.quantity: r for r in c.rows if r.iteration == 1}
    forward_ok = all(not r.differs for q, r in rows.items()
                     if q.startswith(("tokens", "labels", "document", "RoPE", "per-token loss", "training token count")))
    return forward_ok and bool(c.facts.get("grad_bad")) and not c.facts.get("init_differs") \
        and not c.facts.get("grad_rank_spread_bad")


def _row_differs(c: Comparison, prefix: str) -> bool:
    return any(r.differs and r.quantity.startswith(prefix) for r in c.rows)


#: (signature, cause); checked in this order, every match is listed
TABLE: list[tuple[Callable[[Comparison, dict], bool], Cause]] = [
    (lambda c, x: c.facts.get("init_differs", False), Cause(
        "init", "initial weights differ between the CP sizes",
        "the same seed must give the same weights at every CP size; something in the initialisation depends on "
        "the rank layout (a per-rank seed, or CPU vs GPU initialisation)")),
    (lambda c, x: _row_differs(c, "tokens") or _row_differs(c, "labels"), Cause(
        "data", "the batch split differs from Megatron's: tokens or labels wrong at some positions",
        "the CP shard of a rank must be Megatron's zigzag split of the same batch (get_batch_on_this_cp_rank); "
        "labels rolled per shard instead of globally break the token at each shard edge",
        "NVIDIA-NeMo/Automodel#3544 (tokens wrong at shard edges)")),
    (lambda c, x: _row_differs(c, "document starts"), Cause(
        "documents", "a document boundary is missing or moved on a CP rank",
        "with --reset-attention-mask / packed sequences every rank must see every document boundary of its "
        "rows; a boundary dropped on one rank lets its tokens attend across documents",
        "NVIDIA-NeMo/Megatron-Bridge#2952 (document boundaries dropped on middle pipeline stages)")),
    (lambda c, x: _row_differs(c, "RoPE"), Cause(
        "rope", "RoPE positions of a CP rank are wrong",
        "a rank's rotary table must be the one of its global positions (Megatron's zigzag slice, "
        "get_pos_emb_on_this_cp_rank); the table is sliced for another rank or not sliced")),
    (lambda c, x: c.facts.get("grad_rank_spread_bad", False), Cause(
        "unreduced", "a gradient is not reduced over the CP group",
        "after the backward pass every CP rank must hold the same gradient (Megatron's DDP reduces over "
        "DP x CP); a parameter kept out of that reduction (its own buffer, a hook that overwrites main_grad, "
        "a group without CP) keeps each rank's partial gradient")),
    (lambda c, x: (c.facts.get("forward_bad_positions") is not None and x.get("hidden_dropout", 0) > 0), Cause(
        "dropout", "hidden dropout differs with the CP size (by design)",
        "Megatron draws the hidden-dropout mask per local token, so it changes with the CP split; run the "
        "doctor with --hidden-dropout 0 to check the rest (attention dropout through the ring is keyed by "
        "global position and stays invariant)")),
    (lambda c, x: c.facts.get("forward_bad_positions") is not None and not any(
        _row_differs(c, p) for p in ("tokens", "labels", "document", "RoPE")), Cause(
        "forward", "the forward pass differs although inputs, documents and RoPE agree",
        "the attention at CP > 1 (core attention not the ring on some layers, a mask not passed on a rank) or "
        "a layer that mixes tokens across the sequence without CP support")),
    (lambda c, x: _grads_only(c) and _mtp_worst(c, x), Cause(
        "mtp", "multi-token prediction loss weighted per CP rank",
        "Megatron divides each CP rank's MTP loss by that rank's own rolled-token count (the rank holding the "
        "sequence end has one fewer), so the MTP gradients differ from CP=1; set MEGATRON_RING_MTP_CP_INVARIANT=1 "
        "(megatron_ring/megatron/data/mtp_loss.py) with the ring spec",
        "NVIDIA/Megatron-LM#3959")),
    (lambda c, x: _grads_only(c) and (_router_worst(c, x) or (bool(x.get("moe")) and _row_differs(c, "load_balancing"))),
     Cause("moe_aux", "MoE auxiliary loss scaled differently at CP > 1",
           "the load-balancing / z-loss is computed from per-rank token statistics and scaled per rank; its "
           "gradient into the router then changes with the CP size", "NVIDIA/Megatron-LM#5047")),
    (lambda c, x: _grads_only(c), Cause(
        "per_rank_norm", "the loss is normalised per CP rank",
        "the forward pass and the token counts agree but the gradients do not: the loss of each CP rank is "
        "divided by its own token count (or mis-scaled by the CP size) instead of by the global count. Megatron "
        "itself does this without --calculate-per-token-loss (loss / local tokens x CP size), which equals "
        "CP=1 only when every CP rank has the same number of loss tokens (no padding / masked tokens)")),
    (lambda c, x: not c.training_differs and bool(c.facts.get("eval_ratio")) and any(
        abs(r - c.cp) < 1e-3 * c.cp for r in c.facts["eval_ratio"]), Cause(
        "eval_scale", "eval loss reported x cp_size (reporting only)",
        "the evaluation sums the loss over CP ranks without dividing by the CP size; training is unaffected")),
    (lambda c, x: not c.training_differs and c.reporting_differs, Cause(
        "reporting", "a logged value differs while training is identical (reporting only)",
        "the gradients, grad norms, parameters and the loss function's own sums agree; only what the loop "
        "logs differs (how it averages or normalises a logged term)")),
]


def diagnose(c: Comparison, ctx: dict[str, Any]) -> list[Cause]:
    c.facts["grad_rank_spread_bad"] = c.facts.get("grad_rank_spread", 0.0) > c.bounds.get("rel_grad", 0.0)
    found = [cause for sig, cause in TABLE if c.rows and sig(c, ctx)]
    if any(x.key in ("mtp", "moe_aux") for x in found):  # a named per-rank weighting: not the generic one too
        found = [x for x in found if x.key != "per_rank_norm"]
    if c.training_differs and not found:
        found.append(Cause("unknown", "no known cause matches",
                           "look at the first row that differs and at the parameter named there"))
    return found
