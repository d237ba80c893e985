"""``--static``: a preflight of a Megatron-LM command line for context parallelism, without running it.

Checks the CP sizes against the sequence length and heads, the comm type against the features used, the
split a stock script makes, packing / padding / loss normalisation, pipeline stages with CP, and the
known Megatron CP issues against the installed megatron-core (its version read through
``megatron_ring.megatron.compat``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ring_lab.doctor.shrink import Args


@dataclass
class Finding:
    level: str  # "error" (will not run / is wrong), "warn" (CP-variant or risky), "info"
    topic: str
    text: str


#: known Megatron CP issues: (reference, what, applies(args) -> bool, what to do); the releases each affects
#: are in ``megatron_ring.megatron.compat.KNOWN_ISSUE_RELEASES`` (the one place that knows releases)
KNOWN_ISSUES = [
    ("NVIDIA/Megatron-LM#3959", "MTP loss weighted per CP rank (each rank divides by its own rolled-token "
     "count)", lambda a: a.has("--mtp-num-layers"), "MEGATRON_RING_MTP_CP_INVARIANT=1 (with the ring spec)"),
    ("NVIDIA/Megatron-LM#5047", "MoE aux-loss scaling with CP", lambda a: a.has("--num-experts") and any(
        float(x) > 0 for x in (a.values("--moe-aux-loss-coeff") or ["0"])),
     "run the doctor: it compares router gradients and the logged aux loss"),
    ("NVIDIA-NeMo/Megatron-Bridge#2952", "document boundaries dropped on middle pipeline stages (Megatron-Bridge)",
     lambda a: int(a.get("--pipeline-model-parallel-size", "1") or 1) > 2 and (
         a.has("--reset-attention-mask") or a.has("--sft")),
     "check that packed_seq_params / the attention mask reach every stage"),
    ("NVIDIA/Megatron-LM#7452", "silent parallelism bugs found by fuzzing, with CPU/gloo reproductions",
     lambda a: True, "run the doctor at the CP sizes you train with"),
]


def _releases(releases: tuple) -> str:
    first, fixed = releases
    since = "" if first == (0, 0, 0) else f"seen from {'.'.join(map(str, first))}"
    return ", ".join(x for x in (since, f"fixed in {'.'.join(map(str, fixed))}" if fixed else "no fixed release "
                                 "known") if x)


def _ints(a: Args, flag: str, default: int) -> int:
    try:
        return int(a.get(flag, str(default)) or default)
    except ValueError:
        return default


def check(argv: list[str], cps: list[int]) -> tuple[list[Finding], dict[str, Any]]:
    a = Args(argv)
    out: list[Finding] = []
    seq = _ints(a, "--seq-length", 0)
    heads = _ints(a, "--num-attention-heads", 0)
    per_tp = heads // max(1, _ints(a, "--tensor-model-parallel-size", 1))
    comm = a.values("--cp-comm-type") or ["p2p"]
    inner = [int(x) for x in (a.values("--hierarchical-context-parallel-sizes") or []) if x.isdigit()][:1]
    pp = _ints(a, "--pipeline-model-parallel-size", 1)
    for cp in cps:
        if seq and seq % (2 * cp):
            out.append(Finding("error", "sequence", f"--seq-length {seq} is not divisible by 2 x CP = {2 * cp} "
                               "(Megatron's zigzag split): pad the sequence"))
        # the library's rule (megatron_ring.megatron.attention.comm_types.check_heads): a2a splits a TP rank's query
        # heads over the CP ranks (a2a+p2p over the inner group), unevenly where they do not divide; every rank needs
        # one at least. GQA's K/V heads need not divide (docs/strategies.md, "Heads")
        for c in {c for c in comm if c.startswith("a2a")}:
            n = cp if c == "a2a" else (inner[0] if inner else cp)
            if heads and per_tp < n:
                out.append(Finding("error", "heads", f"--cp-comm-type {c} splits the {per_tp} attention heads of a "
                                   f"tensor-parallel rank over {n} ranks, but every rank needs at least one head; "
                                   "use p2p, all_gather or auto (or a smaller inner size)"))
        if seq and seq // (2 * cp) < 8:
            out.append(Finding("warn", "sequence", f"CP={cp} leaves {seq // (2 * cp)} tokens per zigzag chunk"))
    if a.has("--window-size") and any(c.startswith("a2a") for c in comm):
        out.append(Finding("info", "comm type", "sliding windows with a2a: every rank holds the whole "
                           "sequence for its heads; the window applies there unchanged"))
    if a.has("--cp-layout") and a.get("--cp-layout") != "zigzag":
        out.append(Finding("error", "layout", f"--cp-layout {a.get('--cp-layout')}: a stock script splits the "
                           "batch zigzag (get_batch_on_this_cp_rank); the ring's layout must match "
                           "(MEGATRON_RING_LAYOUT=zigzag)"))
    if float(a.get("--hidden-dropout", "0.1") or 0.1) > 0:
        out.append(Finding("warn", "dropout", "hidden dropout > 0 (Megatron's default 0.1): its mask is drawn per "
                           "local token, so training differs with the CP size by design; the doctor checks "
                           "with the flag as given"))
    masked = a.has("--eod-mask-loss") or a.has("--reset-attention-mask") or a.has("--sft")
    if masked and not a.has("--calculate-per-token-loss"):
        out.append(Finding("warn", "loss", "masked loss tokens without --calculate-per-token-loss: Megatron "
                           "divides each CP rank's loss by its own token count (times the CP size), which "
                           "equals CP=1 only when all CP ranks hold the same number of loss tokens"))
    if pp > 1:
        out.append(Finding("info", "pipeline", f"PP={pp} with CP: every stage splits the same sequence; document "
                           "boundaries (packed_seq_params / attention mask) must reach every stage"))
    version, releases, affects = None, {}, lambda ref, v: None
    try:
        from megatron_ring.megatron.compat import KNOWN_ISSUE_RELEASES, known_issue_affects, mcore_version

        releases, affects = KNOWN_ISSUE_RELEASES, known_issue_affects
        version = mcore_version()
    except Exception as e:  # megatron-core not importable here
        out.append(Finding("info", "version", f"megatron-core not importable ({type(e).__name__}): "
                           "known issues listed without a version check"))
    issues = [{"ref": ref, "what": what, "fix": fix, "config": bool(applies(a)), "version": affects(ref, version),
               "releases": _releases(releases[ref]) if ref in releases else "releases not known here",
               "applies": bool(applies(a)) and affects(ref, version) is not False}
              for ref, what, applies, fix in KNOWN_ISSUES]
    return out, {"megatron_core": ".".join(map(str, version)) if version else None, "known_issues": issues}


def format_static(findings: list[Finding], info: dict[str, Any]) -> str:
    lines = [f"static preflight (megatron-core {info['megatron_core'] or 'not installed'})"]
    for f in findings:
        lines.append(f"  [{f.level}] {f.topic}: {f.text}")
    if not findings:
        lines.append("  no problem found")
    lines.append("known Megatron CP issues that apply to this command and megatron-core:")
    for i in info["known_issues"]:
        if i["applies"]:
            lines.append(f"  {i['ref']}: {i['what']} ({i['releases']}); {i['fix']}")
    return "\n".join(lines)
