"""``python -m megatron_ring_lab.doctor [--cp 2,4] [--iters N] [--json FILE] [--static] -- SCRIPT ARGS...``

Runs a Megatron-LM training command (stock ``pretrain_gpt.py`` / ``pretrain_hybrid.py``, an entry script) on
the CPU at CP=1 and at each CP=k, shrunk to a toy model with the same structure, with the same data and
initial weights and ring attention as core attention at every CP size, and says whether CP=k trains (and
reports) the same as CP=1; if not, what differs first and why it likely does. Exit status: 0 invariant,
1 not invariant, 2 could not run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from megatron_ring_lab.doctor import shrink, static  # torch-free: bad input and --static answer at once


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_ring_lab.doctor", description=__doc__.split("\n\n")[1],
                                usage="%(prog)s [--cp 2,4] [--iters N] [--json FILE] [--static] -- SCRIPT ARGS...")
    p.add_argument("--cp", default="2", help="CP sizes to compare with CP=1, comma separated (default 2)")
    p.add_argument("--iters", type=int, default=3, help="training iterations per run (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--static", action="store_true", help="preflight only: check the command, run nothing")
    p.add_argument("--no-shrink", action="store_true", help="run the model as given (plus the CPU flags)")
    p.add_argument("--workdir", help="folder for the runs' records (default: a temporary folder)")
    p.add_argument("--cache", metavar="DIR", help="keep the CP=1 reference run here and reuse it when the script, "
                   "its arguments and the MEGATRON_RING_* environment match (less the variables that act only at "
                   "CP > 1); other environment variables are not part of the key")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    return p


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's import-time notes (no TransformerEngine / Apex)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    opts = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not cmd:
        print("usage: python -m megatron_ring_lab.doctor [options] -- SCRIPT ARGS...", file=sys.stderr)
        return 2
    try:
        cps = sorted({int(x) for x in opts.cp.split(",") if x.strip()})
    except ValueError:
        print(f"--cp {opts.cp!r}: give CP sizes as integers, e.g. --cp 2,4", file=sys.stderr)
        return 2
    if not cps or min(cps) < 2:
        print("--cp: give CP sizes of 2 or more (CP=1 is the reference run)", file=sys.stderr)
        return 2
    script, user_args = os.path.abspath(cmd[0]), cmd[1:]
    if not os.path.isfile(script):
        print(f"{cmd[0]}: no such script", file=sys.stderr)
        return 2

    findings, info = static.check(user_args, cps)
    print(static.format_static(findings, info), flush=True)
    errors = [f for f in findings if f.level == "error"]
    if opts.static:
        result: dict[str, Any] = {"static": [f.__dict__ for f in findings], **info}
        _write_json(opts.json, result)
        return 1 if errors else 0

    if opts.no_shrink:
        args, notes = _cpu_only(user_args, opts.iters), []
    else:
        args, notes = shrink.shrink(user_args, iters=opts.iters, max_cp=max(cps))
        findings, _ = static.check(args, cps)
        errors = [f for f in findings if f.level == "error"]
    if notes:
        print("toy model: " + "; ".join(notes), flush=True)
    if errors:
        print("cannot run: " + "; ".join(f.text for f in errors), file=sys.stderr)
        return 2
    from megatron_ring_lab.doctor import causes as causes_mod  # torch, megatron_ring: only for the runs
    from megatron_ring_lab.doctor import report, run
    from megatron_ring_lab.doctor.compare import compare

    pp = int(shrink.Args(args).get("--pipeline-model-parallel-size", "1") or 1)
    workdir = opts.workdir or tempfile.mkdtemp(prefix="megatron_ring_doctor_")
    os.makedirs(workdir, exist_ok=True)
    ref = run.launch(script, args, 1, workdir, pp=pp, timeout_s=opts.timeout, cache=opts.cache)
    runs = {1: ref}
    if ref.ok:
        for cp in cps:
            runs[cp] = run.launch(script, args, cp, workdir, pp=pp, timeout_s=opts.timeout, cache=opts.cache)
    failed = [r for r in runs.values() if not r.ok]
    if failed:
        for r in failed:
            print(f"CP={r.cp} could not run (exit {r.returncode}); log: {r.folder}/log.txt\n{r.log_tail[-3000:]}",
                  file=sys.stderr)
        _write_json(opts.json, {"error": "could not run", "failed_cp": [r.cp for r in failed]})
        return 2
    ctx = _context(args)
    results, any_differs = [], False
    seconds = {cp: round(r.seconds, 1) for cp, r in runs.items()}
    for cp in cps:
        c = compare(ref.ranks, runs[cp].ranks, cp)
        found = causes_mod.diagnose(c, ctx)
        print("\n" + report.text(c, found), flush=True)
        any_differs |= c.training_differs or c.reporting_differs
        results.append(report.as_json(c, found, {1: seconds[1], cp: seconds[cp]}))
    print("\nrun times (s): " + ", ".join(f"CP={cp} {s:.0f}" + (" (reused)" if runs[cp].cached else "")
                                         for cp, s in seconds.items()))
    _write_json(opts.json, {"toy_model": notes, "arguments": args, "static": [f.__dict__ for f in findings],
                            **info, "results": results, "invariant": not any_differs})
    return 1 if any_differs else 0


def _cpu_only(user_args: list[str], iters: int) -> list[str]:
    a = shrink.Args(user_args)
    a.drop("--context-parallel-size")
    a.set("--train-iters", iters)
    a.set("--log-interval", 1)
    flags = shrink.CPU_FLAGS
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            val = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
            a.set(flag, *([val] if val else []))
    return a.argv()


def _context(args: list[str]) -> dict[str, Any]:
    a = shrink.Args(args)
    return {"mtp": a.has("--mtp-num-layers"), "moe": a.has("--num-experts"),
            "hidden_dropout": float(a.get("--hidden-dropout", "0.1") or 0.1)}


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)
