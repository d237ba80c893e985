"""The doctor's output: one table per CP size, the first difference, likely causes, and the JSON form."""
from __future__ import annotations

from typing import Any

from megatron_ring_lab.doctor.causes import Cause
from megatron_ring_lab.doctor.compare import Comparison


def _cell(s: str, w: int) -> str:
    s = str(s)
    return s if len(s) <= w else s[: w - 1] + "~"


def table(c: Comparison) -> str:
    head = ("quantity", "it", "CP=1", f"CP={c.cp}", "diff", "bound", "verdict")
    rows = [(r.quantity, "" if r.iteration is None else str(r.iteration), r.ref, r.got, f"{r.diff:.3g}",
             f"{r.tol:.3g}", r.verdict + (f"  [{r.where}]" if r.differs and r.where else "")) for r in c.rows]
    widths = [min(max(len(x[i]) for x in [head, *rows]), w) for i, w in enumerate((62, 3, 17, 17, 9, 9, 200))]
    out = [" | ".join(_cell(h, w).ljust(w) for h, w in zip(head, widths)),
           "-+-".join("-" * w for w in widths)]
    out += [" | ".join(_cell(x, w).ljust(w) for x, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(out)


def first_difference(c: Comparison) -> str:
    order = sorted((r for r in c.rows if r.differs), key=lambda r: (r.iteration or 0, r.stage))
    if not order:
        return "none"
    r = order[0]
    return (f"{r.quantity} at iteration {r.iteration}" + (f", {r.where}" if r.where else "") +
            f" (CP=1 {r.ref or '-'}, CP={c.cp} {r.got}; bound {r.tol:.3g})")


def verdict(c: Comparison) -> str:
    if c.training_differs:
        return f"CP={c.cp} TRAINS DIFFERENTLY from CP=1"
    if c.reporting_differs:
        return f"CP={c.cp} trains the same as CP=1; a logged value differs (reporting only)"
    return f"CP={c.cp} is invariant: trains and reports the same as CP=1 within fp32 rounding"


def text(c: Comparison, causes: list[Cause]) -> str:
    lines = [table(c), "", f"verdict: {verdict(c)}", f"first difference: {first_difference(c)}"]
    bad = c.facts.get("grad_bad", [])
    if bad:
        lines.append("gradients beyond the bound (worst first, |d|/|g|): " +
                     ", ".join(f"{n} {e:.2g}" for n, e in bad[:5]) + (f", ... ({len(bad)} in all)" if len(bad) > 5 else ""))
    for cause in causes:
        lines.append(f"likely cause: {cause.name} -- {cause.explain}" + (f" [{cause.refs}]" if cause.refs else ""))
    return "\n".join(lines)


def as_json(c: Comparison, causes: list[Cause], seconds: dict[int, float]) -> dict[str, Any]:
    return {"cp": c.cp, "invariant": not (c.training_differs or c.reporting_differs),
            "training_differs": c.training_differs, "reporting_only": (not c.training_differs) and c.reporting_differs,
            "verdict": verdict(c), "first_difference": first_difference(c),
            "causes": [{"key": x.key, "name": x.name, "refs": x.refs} for x in causes],
            "bounds": c.bounds, "rows": [r.as_dict() for r in c.rows],
            "gradients_beyond_bound": c.facts.get("grad_bad", []), "seconds": seconds}
