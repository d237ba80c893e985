"""Compare a CP=k run with the CP=1 run: one row per quantity, with a derived fp32 tolerance.

Tolerances (fp32, ``eps = 2**-23``). Changing the CP size changes the order of floating-point sums (attention
over keys, the loss over tokens, gradients over tokens and ranks), never what is summed, so every difference
must be rounding. With ``n_red = max(seq, hidden, ffn)`` (the longest reduction behind one activation),
``n_tok`` the tokens of one iteration and ``depth = layers + 2`` (each layer, the embedding and the output
layer add their rounding):

* per-token values (the loss of a token, iteration 1): ``|d| <= 4 eps sqrt(n_red) depth |x|`` (``rel_fwd``);
  means of them (the losses) get the same relative bound, times the iteration number after updates;
* a gradient tensor, which also sums over ``n_tok`` tokens: ``||d||_2 <= 4 eps sqrt(n_red n_tok) depth ||g||_2``
  (``rel_grad``), and the same bound on the largest element against the largest reference element;
  the grad norm: ``rel_grad`` times the iteration;
* parameters after N iterations: the update ``p_N - p_0`` within ``N rel_grad`` of the CP=1 update (L2), plus
  ``2 lr`` for every element whose step-1 gradient is within the gradient bound of 0 (Adam's first step is
  ``lr sign(g)``: rounding may flip it);
* what must be exact: token ids, labels, document boundaries, token counts, the initial weights, the RoPE
  table (computed the same way for the same position).

The factor 4 covers the random-walk constant of rounding errors; sqrt(n) is the usual growth of a sum's
rounding error with its length. Measured clean gradient differences are ~700x below these bounds, the
planted bugs 40 - 2000x above them (docs/doctor.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megatron_ring import get_layout

EPS = 2.0 ** -23

TRAINING, REPORTING = "training", "reporting"


@dataclass
class Row:
    quantity: str
    iteration: int | None
    ref: str
    got: str
    diff: float
    tol: float
    kind: str
    where: str = ""
    verdict: str = "ok"
    stage: int = 0  # causal order within an iteration, for "first difference" (see STAGES)

    @property
    def differs(self) -> bool:
        return not (self.diff <= self.tol)  # NaN differs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Comparison:
    cp: int
    rows: list[Row] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)

    @property
    def training_differs(self) -> bool:
        return any(r.differs and r.kind == TRAINING for r in self.rows)

    @property
    def reporting_differs(self) -> bool:
        return any(r.differs and r.kind == REPORTING for r in self.rows)


#: causal order of the quantities within one iteration: inputs, forward, weights, counts, loss, gradients
#: (equal over ranks first), grad norm, what is logged, parameters, evaluation
STAGES = (("tokens", 0), ("labels", 0), ("document", 0), ("RoPE", 0), ("per-token loss", 1), ("initial", 2),
          ("gradients equal", 5), ("gradients", 6), ("grad norm", 7), ("parameters", 9), ("eval", 10))


def _stage(row: Row) -> int:
    if row.quantity.startswith("training token count"):
        return 3
    if row.quantity.startswith("training loss"):
        return 4
    for prefix, stage in STAGES:
        if row.quantity.startswith(prefix):
            return stage
    return 8  # reported / logged values


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.9g}"
    return str(x)


def _by_cp_rank(ranks: list[dict]) -> dict[int, list[dict]]:
    """cp rank -> that rank's records over pipeline stages (data-parallel / tensor-parallel rank 0)."""
    out: dict[int, list[dict]] = {}
    for r in ranks:
        m = r["meta"]
        if m.get("dp_rank", 0) == 0 and m.get("tp_rank", 0) == 0:
            out.setdefault(m.get("cp_rank", 0), []).append(r)
    return out


def _merged(recs: list[dict], key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in recs:
        out.update(r.get(key) or {})
    return out


def _last_stage(recs: list[dict]) -> dict:
    return max(recs, key=lambda r: r["meta"].get("pp_rank", 0))


def _global_tokens(ranks: list[dict]) -> dict[str, list[torch.Tensor]] | None:
    """Iteration 1's per-token records of one run placed at global positions: name -> [per micro-batch]."""
    by = _by_cp_rank(ranks)
    cp = len(by)
    out: dict[str, list[torch.Tensor]] = {}
    n_micro = min(len(rec["tokens"]) for recs in by.values() for rec in recs) if by else 0
    for m in range(n_micro):
        for name in ("input_ids", "labels", "loss", "first_key", "rope"):
            parts = []
            for r in range(cp):
                recs = [rec for rec in by[r] if name in rec["tokens"][m] and not rec["tokens"][m]["packed"]]
                if not recs:
                    break
                parts.append(recs[-1]["tokens"][m][name])
            if len(parts) != cp:
                continue
            seq_dim = 0 if name == "rope" else 1
            S = sum(p.shape[seq_dim] for p in parts)
            full = torch.zeros(*([S] if name == "rope" else [parts[0].shape[0], S]),
                               *parts[0].shape[seq_dim + 1:], dtype=parts[0].dtype)
            for r, p in enumerate(parts):
                pos = get_layout("zigzag").positions(S, cp, r) if cp > 1 else torch.arange(S)
                full.index_copy_(seq_dim, pos, p)
            out.setdefault(name, []).append(full)
    return out or None


def bounds(meta: dict) -> dict[str, float]:
    S, h = meta.get("seq_length", 64), meta.get("hidden_size", 64)
    ffn = meta.get("ffn_hidden_size") or 4 * h
    n_red = max(S, h, ffn)
    n_tok = meta.get("global_batch_size", 1) * S
    depth = meta.get("num_layers", 1) + 2
    return {"rel_fwd": 4 * EPS * math.sqrt(n_red) * depth, "rel_grad": 4 * EPS * math.sqrt(n_red * n_tok) * depth,
            "n_red": n_red, "n_tok": n_tok, "depth": depth}


def compare(ref_ranks: list[dict], got_ranks: list[dict], cp: int) -> Comparison:
    c = Comparison(cp)
    ref_by, got_by = _by_cp_rank(ref_ranks), _by_cp_rank(got_ranks)
    meta = ref_ranks[0]["meta"]
    b = bounds(meta)
    c.bounds = b
    rel_fwd, rel_grad = b["rel_fwd"], b["rel_grad"]
    iters = meta.get("train_iters") or 1
    lr = meta.get("lr") or 0.0
    c.facts.update(hidden_dropout=meta.get("hidden_dropout", 0.0), attention_dropout=meta.get("attention_dropout", 0.0))

    def add(row: Row) -> None:
        row.stage = _stage(row)
        c.rows.append(row)

    # ---- iteration 1 inputs, RoPE, documents, per-token loss -----------------------------------------
    ref_tok, got_tok = _global_tokens(ref_ranks), _global_tokens(got_ranks)
    if ref_tok and got_tok:
        for name, label in (("input_ids", "tokens (iteration 1, by global position)"),
                            ("labels", "labels (iteration 1)"),
                            ("first_key", "document starts (attention mask, iteration 1)")):
            if name not in ref_tok or name not in got_tok:
                continue
            bad = [(m, torch.nonzero(a != g)) for m, (a, g) in enumerate(zip(ref_tok[name], got_tok[name]))]
            bad = [(m, idx) for m, idx in bad if idx.numel()]
            where = ""
            if bad:
                m, idx = bad[0]
                pos = idx[0].tolist()
                rank = _rank_of(pos[-1], meta.get("seq_length", 64), cp)
                where = f"micro-batch {m + 1}, row {pos[0]}, position {pos[-1]} (CP rank {rank})"
                c.facts.setdefault("first_bad_position", {})[name] = {"position": pos[-1], "rank": rank,
                                                                      "count": int(idx.shape[0])}
            n = sum(int(idx.shape[0]) for _, idx in bad)
            add(Row(label, 1, "", f"{n} differ" if n else "equal", float(n), 0.0, TRAINING, where))
        if "rope" in ref_tok and "rope" in got_tok:
            d = max(float((a - g).abs().max()) for a, g in zip(ref_tok["rope"], got_tok["rope"]))
            where = ""
            if d > 0:
                diff = (ref_tok["rope"][0] - got_tok["rope"][0]).abs().amax(-1)
                pos = torch.nonzero(diff > 0).flatten().tolist()
                ranks = sorted({_rank_of(p, meta.get("seq_length", 64), cp) for p in pos})
                where = f"positions {pos[0]}..{pos[-1]} ({len(pos)} of {diff.numel()}), CP rank(s) {ranks}"
                c.facts["rope_ranks"] = ranks
            add(Row("RoPE angles per position (first attention layer)", 1, "", "equal" if d == 0 else f"max |d| {d:.3g}",
                    d, 0.0, TRAINING, where))
        if "loss" in ref_tok and "loss" in got_tok:
            worst, where, bad_pos = 0.0, "", set()
            for m, (a, g) in enumerate(zip(ref_tok["loss"], got_tok["loss"])):
                tol = rel_fwd * a.abs().clamp(min=1.0)
                excess = (a - g).abs() / tol
                if float(excess.max()) > worst:
                    worst = float(excess.max())
                    i = int(excess.argmax())
                    row, pos = divmod(i, a.shape[-1])
                    where = f"micro-batch {m + 1}, row {row}, position {pos} (CP rank {_rank_of(pos, a.shape[-1], cp)})"
                bad_pos |= set(torch.nonzero((excess > 1).any(0)).flatten().tolist())
            if bad_pos:
                S = ref_tok["loss"][0].shape[-1]
                c.facts["forward_bad_positions"] = sorted(bad_pos)
                c.facts["forward_bad_ranks"] = sorted({_rank_of(p, S, cp) for p in bad_pos})
                c.facts["forward_bad_fraction"] = len(bad_pos) / S
            add(Row("per-token loss (iteration 1, forward)", 1, "", f"{len(bad_pos)} positions beyond the bound"
                    if bad_pos else "within", worst, 1.0, TRAINING, where))
    # ---- initial weights -----------------------------------------------------------------------------
    ref_p0, got_p0 = _merged(ref_by[0], "init_params"), _merged(got_by[0], "init_params")
    d0, where = 0.0, ""
    for name, a in ref_p0.items():
        g = got_p0.get(name)
        d = float("inf") if g is None or g.shape != a.shape else float((a - g).abs().max()) if a.numel() else 0.0
        if d > d0:
            d0, where = d, name
    add(Row("initial weights (max |d|)", 0, "", _fmt(d0), d0, 0.0, TRAINING, where))
    c.facts["init_differs"] = d0 > 0
    # ---- per-iteration scalars -----------------------------------------------------------------------
    ref_last, got_last = _last_stage(ref_by[0]), _last_stage(got_by[0])
    for it in sorted(ref_last["iters"]):
        ri, gi = ref_last["iters"][it], got_last["iters"].get(it)
        if gi is None:
            add(Row("iteration missing at CP=k", it, "present", "missing", math.inf, 0, TRAINING))
            continue
        # what the loss function returns for training, over all CP ranks and micro-batches
        (lr_, nr), (lg, ng) = _train_loss(ref_by, it), _train_loss(got_by, it)
        if nr is not None or ng is not None:
            add(Row("training token count (loss function, all CP ranks)", it, _fmt(nr), _fmt(ng),
                    abs((nr or 0) - (ng or 0)) if nr is not None and ng is not None else math.inf, 0.0, TRAINING))
        if lr_ is not None:
            mr = lr_ / nr if nr else lr_
            mg = (lg / ng if ng else lg) if lg is not None else math.nan
            add(Row("training loss (loss function output / tokens, all CP ranks)", it, _fmt(mr), _fmt(mg),
                    abs(mr - mg), rel_fwd * it * max(abs(mr), 1.0), TRAINING))
        for key in sorted(set(ri["reported"]) | set(gi["reported"])):
            a, g = ri["reported"].get(key, math.nan), gi["reported"].get(key, math.nan)
            add(Row(f"{key} (reported)", it, _fmt(a), _fmt(g), abs(a - g), rel_fwd * it * max(abs(a), 1.0), REPORTING))
        for key in sorted(set(ri["logged"]) | set(gi["logged"])):
            a, g = ri["logged"].get(key, math.nan), gi["logged"].get(key, math.nan)
            add(Row(f"{key} (logged)", it, _fmt(a), _fmt(g), abs(a - g), rel_fwd * it * max(abs(a), 1.0), REPORTING))
        if ri["grad_norm"] is not None:
            a, g = ri["grad_norm"], gi["grad_norm"] if gi["grad_norm"] is not None else math.nan
            add(Row("grad norm", it, _fmt(a), _fmt(g), abs(a - g), rel_grad * it * abs(a), TRAINING))
    # ---- gradients after step 1 ----------------------------------------------------------------------
    ref_g, got_g = _merged(ref_by[0], "grads1"), _merged(got_by[0], "grads1")
    grad_rows = []
    for name, a in ref_g.items():
        g = got_g.get(name)
        if g is None or g.shape != a.shape:
            grad_rows.append((math.inf, name, 0.0, 0.0))
            continue
        na = float(a.norm())
        rel = float((a - g).norm()) / na if na > 0 else float((a - g).norm() > 0) * math.inf
        mx = float((a - g).abs().max()) / max(float(a.abs().max()), 1e-30) if a.numel() else 0.0
        grad_rows.append((max(rel, mx), name, na, float(g.norm())))
    grad_rows.sort(reverse=True)
    bad = [r for r in grad_rows if r[0] > rel_grad]
    c.facts["grad_bad"] = [(n, e) for e, n, *_ in bad]
    c.facts["grad_all"] = [(n, e) for e, n, *_ in grad_rows]
    worst = grad_rows[0] if grad_rows else (0.0, "", 0.0, 0.0)
    add(Row(f"gradients after step 1 ({len(bad)} of {len(grad_rows)} tensors beyond the bound)", 1,
            f"|g| {worst[2]:.4g}", f"|g| {worst[3]:.4g}", worst[0], rel_grad, TRAINING, worst[1]))
    # the same gradient on every CP rank (Megatron reduces over DP x CP)
    spread, where = 0.0, ""
    for r, recs in got_by.items():
        if r == 0:
            continue
        other = _merged(recs, "grads1")
        for name, a in got_g.items():
            o = other.get(name)
            if o is None:
                continue
            na = float(a.norm())
            d = float((a - o).norm()) / na if na > 0 else float((a - o).norm())
            if d > spread:
                spread, where = d, f"{name} (CP rank 0 vs {r})"
    c.facts["grad_rank_spread"] = spread
    c.facts["grad_rank_spread_where"] = where
    add(Row("gradients equal on every CP rank (step 1)", 1, "", _fmt(spread), spread, rel_grad, TRAINING, where))
    # ---- parameters after the last iteration ---------------------------------------------------------
    ref_pN, got_pN = _merged(ref_by[0], "final_params"), _merged(got_by[0], "final_params")
    worst_p, where = 0.0, ""
    for name, a in ref_pN.items():
        g, p0 = got_pN.get(name), ref_p0.get(name)
        if g is None or p0 is None or g.shape != a.shape:
            continue
        upd = float((a - p0).norm())
        g1 = ref_g.get(name)
        flips = int((g1.abs() <= rel_grad * float(g1.abs().max())).sum()) if g1 is not None else 0
        tol = iters * rel_grad * upd + 2 * lr * math.sqrt(flips)
        e = float((a - g).norm()) / tol if tol > 0 else (math.inf if float((a - g).norm()) > 0 else 0.0)
        if e > worst_p:
            worst_p, where = e, name
    add(Row(f"parameters after iteration {iters} (|d| / bound)", iters, "", _fmt(worst_p), worst_p, 1.0,
            TRAINING, where))
    # ---- evaluation ----------------------------------------------------------------------------------
    ref_ev, got_ev = ref_last.get("eval", []), got_last.get("eval", [])
    for k, ev in enumerate(ref_ev):
        gev = got_ev[k] if k < len(got_ev) else {"losses": {}}
        for key, a in ev["losses"].items():
            g = gev["losses"].get(key, math.nan)
            add(Row(f"eval {key}", ev["after"], _fmt(a), _fmt(g), abs(a - g),
                    rel_fwd * (ev["after"] + 1) * max(abs(a), 1.0), REPORTING))
            if g == g and a:
                c.facts.setdefault("eval_ratio", []).append(g / a)
    for row in c.rows:
        row.verdict = "DIFFERS" if row.differs else "ok"
    if not c.training_differs:
        for row in c.rows:
            if row.differs:
                row.verdict = "reporting only"
    return c


def _rank_of(pos: int, S: int, cp: int) -> int:
    if cp <= 1:
        return 0
    chunk = S // (2 * cp)
    k = pos // chunk
    return k if k < cp else 2 * cp - 1 - k


def _train_loss(by: dict[int, list[dict]], it: int) -> tuple[float | None, float | None]:
    """(sum of the training losses, sum of the token counts or None) over CP ranks and micro-batches."""
    total, count, seen = 0.0, 0.0, False
    has_count = True
    for recs in by.values():
        for vals in _last_stage(recs)["iters"].get(it, {}).get("train", []):
            seen = True
            total += vals[0]
            if len(vals) == 2:
                count += vals[1]
            else:
                has_count = False
    if not seen:
        return None, None
    return total, (count if has_count else None)
