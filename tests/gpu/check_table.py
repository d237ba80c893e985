"""scripts/gpu_check.sh's last step: read its output folder and print ONE table; exit 1 if any row failed.

``python tests/gpu/check_table.py OUT NGPU`` where ``OUT`` holds, per step that ran, its log and a ``<step>.rc``
file (the step's exit status; 124 = its time budget ran out): ``pytest.txt``, ``nccl.txt``, ``te.txt``,
``layer.txt`` (the layer host-time row), ``plan.txt`` (the planning rows), ``bench.json`` (+ ``bench.err``). A step whose rc file is absent did not run (a skipped row says why)."""
from __future__ import annotations

import json
import os
import sys


def _read(out, name):
    path = os.path.join(out, name)
    return open(path).read() if os.path.exists(path) else None


def _rc(out, step):
    text = _read(out, f"{step}.rc")
    return None if text is None else int(text.strip() or 1)


def _status(rc):
    return "ok" if rc == 0 else "FAIL timeout" if rc == 124 else f"FAIL rc={rc}"


def rows(out: str) -> list[tuple[str, str, str]]:
    """(check, detail, result) rows; result is "ok", "skipped" or starts with "FAIL"."""
    res = []
    rc, log = _rc(out, "pytest"), (_read(out, "pytest.txt") or "").strip().splitlines()
    res.append(("tests/gpu", log[-1] if log else "no output", _status(rc) if rc is not None else "FAIL not run"))
    failed = [ln for ln in log if ln.startswith(("FAILED", "ERROR"))]
    fake = [ln for ln in failed if "test_fake_tier_on_gpu" in ln]
    if failed:
        res.append(("tests/gpu failures", f"{len(failed)} ({len(fake)} of the fake tier for real): "
                    + failed[0][:200], "FAIL"))
    for step, name, need in (("nccl", "ring over NCCL", "2 or more GPUs"),
                             ("te", "ours vs TE context parallel", "TransformerEngine and 2 or more GPUs")):
        rc = _rc(out, step)
        if rc is None:
            res.append((name, f"not run (needs {need})", "skipped"))
            continue
        lines = (_read(out, f"{step}.txt") or "").splitlines()
        found = [json.loads(ln) for ln in lines if ln.startswith("{")]
        for r in found:
            detail = (f"max err {r['max_err']:.2e}, {r['ms']} ms fwd+bwd" if step == "nccl" else
                      f"ours {r['ours_ms']} ms err {r['ours_err']:.2e} | TE {r['te_ms']} ms err {r['te_err']:.2e}")
            res.append((r["case"], detail, "ok" if r["ok"] else "FAIL"))
        if rc or not found:
            res.append((name, " / ".join(lines[-3:])[-300:] or "no output", _status(rc) if rc else "FAIL no rows"))
    rc = _rc(out, "layer")
    if rc is not None:
        lines = (_read(out, "layer.txt") or "").strip().splitlines()
        row = [ln for ln in lines if ln.startswith("layer fwd+bwd")]
        res.append(("layer host time", (row or lines or ["no output"])[-1][:300],
                    _status(rc) if rc or row else "FAIL no row"))
    rc = _rc(out, "plan")
    if rc is not None:
        lines = (_read(out, "plan.txt") or "").strip().splitlines()
        found = [ln for ln in lines if ln.startswith("| ") and ln[2:3].isdigit()]  # the table's rows
        for ln in found:
            res.append(("plan a new document layout", ln.strip("| ").replace(" | ", ", "), _status(rc)))
        if rc or not found:
            res.append(("plan time", (lines or ["no output"])[-1][:300], _status(rc) if rc else "FAIL no row"))
    rc, text = _rc(out, "bench"), _read(out, "bench.json") or ""
    try:
        bench = json.loads(text[text.index("["):])
    except ValueError:
        bench = []
    for r in bench:
        detail = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k != "P")
        res.append((f"bench P={r.get('P')}", detail, _status(rc) if rc is not None else "FAIL"))
    if rc or not bench:
        err = (_read(out, "bench.err") or "").strip()[-300:]
        res.append(("benchmark rows", err or "no rows", _status(rc) if rc else "FAIL no rows"))
    return res


def main(argv: list[str]) -> int:
    out, ngpu = argv[0], int(argv[1])
    table = rows(out)
    w = max(len(r[0]) for r in table)
    print(f"\n[gpu_check] {ngpu} GPU(s)\n{'check':<{w}}  {'result':<12}  detail")
    for name, detail, result in table:
        print(f"{name:<{w}}  {result:<12}  {detail}")
    return 0 if all(r[2] in ("ok", "skipped") for r in table) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
