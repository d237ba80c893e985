"""Paired timing of ring attention at two revisions of this repository (e.g. before and after a refactor).

    .venv/bin/python scripts/bench_revisions.py 34cad64 HEAD --world-sizes 2 4 --seq 8192 --rounds 3

Each revision is checked out into a temporary git worktree. Per round, for every (P, causal) the two
revisions run one after the other (their order alternates between rounds), each as P gloo processes with
one thread each, timing forward+backward of ``megatron_ring.ring_attention`` (zigzag, fp32) over
``--iters`` calls after one warm-up call; a call's time is the slowest rank's. Printed per (P, causal):
each revision's median, and the median over rounds of the within-round ratio B/A with its spread (min-max),
which is the noise to compare against. Uses only ``ring_attention``, whose signature both revisions share.

    .venv/bin/python scripts/bench_revisions.py 76eb4bf HEAD --host-time --rounds 5

``--host-time``: per round each revision runs THIS checkout's ``lab/megatron_ring_lab/bench/host_time.py``
(the engine's own host time: loopback ring, instant kernel, P = 2..8, one process, one thread; it uses only
``ring_attention``, ``LoopbackRing`` and ``BlockKernel``, which older revisions have too) against its own
library, order alternating; printed per causal: each revision's median fitted host time per ring step and
fixed per call, and the medians over rounds of the within-round ratios B/A with their spread.

    .venv/bin/python scripts/bench_revisions.py 57a9467 HEAD --layer-host-time --rounds 5

``--layer-host-time``: per round each revision runs THIS checkout's
``lab/megatron_ring_lab/bench/layer_host_time.py`` (host time of one Megatron core-attention layer call,
``RingDotProductAttention`` forward+backward at CP = 1, and the same ``ring_attention`` call made directly)
against its own library, order alternating; printed: each revision's median per mode and the medians over rounds
of the within-round ratios B/A with their spread, and whether the layer's outputs and gradients are
bit-identical between the revisions. ``--layer-packed``: the same on a packed THD batch of three documents, and
the first layer of a micro-batch (new ``PackedSeqParams`` each call) beside the later ones.

    python scripts/bench_revisions.py 59a641f HEAD --gpu-rows --rounds 3
    python scripts/bench_revisions.py A B --trees /path/to/tree_a /path/to/tree_b --gpu-rows

``--gpu-rows`` (a CUDA GPU): the GPU benchmark row of each revision's own lab
(``megatron_ring_lab.bench.gpu.gpu_row``: every rank's ring schedule on the one GPU through the loopback, bf16,
GQA 32:8, head dim 128, causal; ``--gpu-sizes P:tokens_per_rank ...``, ``--gpu-docs`` for packed documents, each
size ``--iters`` calls, default 7) in one worker process per revision, sizes and revisions interleaved, the order
alternating between rounds after a dropped warm-up round; printed per size: each revision's median host ms per
call and efficiency, launches per call, and the median over rounds of the slowest rank's time B/A with its
spread; then, where a revision's rows carry it, the slowest rank's kernel GPU time by kind (attention, merge,
list op, copies, other) beside the one-GPU reference's attention kernels, and the host time by part (forward,
backward, and under cProfile the attention ops, other ops, Triton, this library's Python, the rest). ``--trees A B``: two prepared trees (``rev_a``, ``rev_b`` then only name them), for a machine without
this repository's git history (a lent GPU gets the working tree only).

    .venv/bin/python scripts/bench_revisions.py 3d3bfe4 HEAD --plan-time --rounds 3

``--plan-time``: per round each revision runs THIS checkout's ``lab/megatron_ring_lab/bench/plan_time.py`` (host
time to plan a new document layout, the first layer of every micro-batch on a packed batch: ring tasks and segment
plans on the GPU's whole-block path, slowest rank, ``--iters`` new mixes per row) against its own library, order
alternating; printed per row of its grid: each revision's median and the median over rounds of the within-round
ratio B/A with its spread, and the masked tasks with a segment plan in each. ``--plan-tiles``: the CPU engine's
planning instead (tile schedules for the math kernel, no segment plans).

    .venv/bin/python scripts/bench_revisions.py aa3e893 HEAD --outputs

``--outputs``: no timing; checks that the two revisions compute bit-identical results. Per world size
(``--world-sizes``, gloo processes) each revision runs one forward+backward of every case of
:data:`OUTPUT_CASES` (layouts, formats, causal, documents, windows, GQA, wire dtypes, K/V pieces, head
chunks, sinks, dropout, MLA head dims) and hashes the bytes of the output and of dq, dk, dv (and the sink gradient) on
every rank; printed: the cases whose hashes differ (none: "bit-identical").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any

WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = json.loads(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
from megatron_ring import ring_attention, shard_sequence
g = torch.Generator().manual_seed(0)
S, H, D = cfg["seq"], cfg["heads"], cfg["head_dim"]
q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
q, k, v = (shard_sequence(x, dim=1, layout="zigzag").clone().requires_grad_(True) for x in (q, k, v))
dout = torch.randn_like(q)
times = []
for i in range(cfg["iters"] + 1):
    dist.barrier()
    t0 = time.perf_counter()
    ring_attention(q, k, v, causal=cfg["causal"], layout="zigzag").backward(dout)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if i:
        times.append(float(t))
print("RESULT " + json.dumps(times), flush=True)  # every rank: the times are the max over ranks already
dist.barrier()
# leave without interpreter finalisation: a gloo thread may still drop its last all-reduce Work object,
# which takes the GIL, and a thread taking the GIL during finalisation aborts the process
os._exit(0)
"""


#: ``--outputs``: the cases every revision runs (keyword arguments of ``ring_attention``; ``thd``: packed
#: documents with these global boundaries; ``gqa``: K/V heads; ``sink``: a learnable softmax offset)
OUTPUT_CASES = [
    dict(causal=False), dict(causal=True), dict(causal=True, layout="striped"),
    dict(causal=True, layout="contiguous"), dict(causal=True, qkv_format="sbhd"),
    dict(causal=True, gqa=2), dict(causal=True, kv_pieces=2), dict(causal=False, kv_pieces=4, gqa=4),
    dict(causal=True, head_chunks=2), dict(causal=True, comm_dtype="bf16"), dict(causal=True, comm_dtype="fp8"),
    dict(causal=False, comm_dtype="fp16", kv_pieces=2), dict(causal=True, window=(40, -1)),
    dict(causal=True, thd=[0, 50, 130, 200]), dict(causal=True, sink=True), dict(causal=True, dropout_p=0.25),
    dict(causal=True, comm_type="all_gather"), dict(causal=True, comm_type="all_gather", comm_dtype="fp8"),
    dict(causal=False, comm_type="a2a", comm_dtype="fp8"), dict(causal=True, comm_type="a2a", gqa=2),
    # MLA head dims (d_qk, d_v): the CPU flash kernel takes one head dim, so its operands are padded
    dict(causal=True, dims=(24, 16)), dict(causal=False, dims=(16, 24), gqa=2),
    dict(causal=True, dims=(24, 16), window=(40, -1)), dict(causal=True, dims=(24, 16), thd=[0, 50, 130, 200]),
    dict(causal=True, dims=(24, 16), kv_pieces=2, gqa=2), dict(causal=True, dims=(24, 16), comm_type="all_gather"),
]

OUTPUT_WORKER = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cases = json.loads(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
from megatron_ring import ring_attention, shard_sequence
out = []
S, H, D = 240 * world // 2 * 2, 4, 16
for i, case in enumerate(cases):
    case = dict(case)
    g = torch.Generator().manual_seed(i)
    hk = case.pop("gqa", H)
    dqk, dv = case.pop("dims", (D, D))
    thd, sink = case.pop("thd", None), case.pop("sink", False)
    fmt = case.get("qkv_format", "bshd")
    layout = case.get("layout", "zigzag")
    def make(h, d):
        x = torch.randn(1, S, h, d, generator=g)
        x = shard_sequence(x, dim=1, layout=layout)
        if thd is not None:
            x = x[0]
        elif fmt == "sbhd":
            x = x.transpose(0, 1).contiguous()
        return x.clone().requires_grad_(True)
    q, k, v = make(H, dqk), make(hk, dqk), make(hk, dv)
    kw = dict(case)
    if thd is not None:
        kw.update(qkv_format="thd", cu_seqlens=torch.tensor(thd))
    if kw.get("dropout_p"):
        kw["dropout_seed"] = 1234
    if kw.get("comm_dtype") == "bf16":
        kw["comm_dtype"] = torch.bfloat16
    if kw.get("comm_dtype") == "fp16":
        kw["comm_dtype"] = torch.float16
    off = torch.randn(H, generator=g).requires_grad_(True) if sink else None
    o = ring_attention(q, k, v, softmax_offset=off, **kw)
    o.backward(torch.randn(o.shape, generator=g))
    h = hashlib.sha256()
    for t in (o, q.grad, k.grad, v.grad) + ((off.grad,) if sink else ()):
        h.update(t.detach().contiguous().numpy().tobytes())
    out.append(h.hexdigest())
print("RESULT " + json.dumps(out), flush=True)
dist.barrier()
os._exit(0)
"""


def _outputs(tree: str, world: int, timeout: float) -> list[list[str]]:
    """Per rank, the hash of each case's results (:data:`OUTPUT_CASES`) computed by the library in ``tree``."""
    return _spawn(tree, world, OUTPUT_WORKER, OUTPUT_CASES, timeout)


def _output_rows(trees: list[str], a) -> list[dict]:
    rows = []
    for world in a.world_sizes:
        ha, hb = _outputs(trees[0], world, a.timeout), _outputs(trees[1], world, a.timeout)
        differ = [OUTPUT_CASES[i] for i in range(len(OUTPUT_CASES))
                  if any(ha[r][i] != hb[r][i] for r in range(world))]
        rows.append(dict(P=world, cases=len(OUTPUT_CASES), differ=differ))
        print(f"P={world}: {len(OUTPUT_CASES)} cases, " + (f"DIFFERENT results in {differ}" if differ else
                                                          "bit-identical outputs and gradients on every rank"),
              flush=True)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tree: str, world: int, cfg: dict, timeout: float) -> float:
    return statistics.median(_spawn(tree, world, WORKER, cfg, timeout)[0])


def _spawn(tree: str, world: int, worker: str, payload, timeout: float) -> list:
    """``world`` processes running ``worker`` (source) with the library in ``tree`` on a free port (each wait
    bounded by ``timeout``); per rank, the JSON after its ``RESULT`` line."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), str(world), str(port), json.dumps(payload)],
                              env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
    got = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"worker failed in {tree}:\n{err[-2000:]}")
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        got.append(json.loads(line[len("RESULT "):]))
    return got


HOST_TIME = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "lab", "megatron_ring_lab", "bench",
                         "host_time.py")
LAYER_HOST_TIME = os.path.join(os.path.dirname(HOST_TIME), "layer_host_time.py")
PLAN_TIME = os.path.join(os.path.dirname(HOST_TIME), "plan_time.py")


def _host_time(tree: str, iters: int, timeout: float, script: str = HOST_TIME, extra: tuple = ()) -> Any:
    """One run of a host-time row (this checkout's ``script``) against the library in ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.abspath(script), "--json", "--iters", str(iters), *extra], env=env,
                         cwd=tree, capture_output=True, text=True, timeout=timeout)
    if res.returncode:
        raise RuntimeError(f"host-time run failed in {tree}:\n{res.stderr[-2000:]}")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _host_time_rows(trees: list[str], a) -> list[dict]:
    runs: dict[int, list[list[dict]]] = {0: [], 1: []}
    for rnd in range(a.rounds):
        for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            runs[i].append(_host_time(trees[i], a.iters, a.timeout))
    rows = []
    for c, causal in enumerate((False, True)):
        row = dict(causal=causal)
        for key in ("per_step_s", "fixed_s"):
            xa = [r[c][key] for r in runs[0]]
            xb = [r[c][key] for r in runs[1]]
            ratios = [b / x for x, b in zip(xa, xb)]
            row[key] = dict(a=statistics.median(xa), b=statistics.median(xb), ratio=statistics.median(ratios),
                            ratio_min=min(ratios), ratio_max=max(ratios))
        for i, side in ((0, "a"), (1, "b")):
            row[f"{side}_call_s"] = {p: statistics.median(r[c]["call_s"][p] for r in runs[i]) for p in runs[i][0][c]["call_s"]}
        rows.append(row)
        ps, st, fx = list(row["a_call_s"]), row["per_step_s"], row["fixed_s"]
        print(f"causal={causal!s:5}  per step: {a.rev_a} {st['a'] * 1e3:.3f} ms  {a.rev_b} {st['b'] * 1e3:.3f} ms  ratio "
              f"{st['ratio']:.3f} ({st['ratio_min']:.3f}-{st['ratio_max']:.3f});  fixed per call: {a.rev_a} "
              f"{fx['a'] * 1e3:.3f} ms  {a.rev_b} {fx['b'] * 1e3:.3f} ms  ratio {fx['ratio']:.3f} "
              f"({fx['ratio_min']:.3f}-{fx['ratio_max']:.3f})", flush=True)
        for side, rev in (("a", a.rev_a), ("b", a.rev_b)):
            print(f"    {rev:>10} call ms: " + "  ".join(f"P={p} {row[f'{side}_call_s'][p] * 1e3:.3f}" for p in ps),
                  flush=True)
    return rows


def _layer_host_time_rows(trees: list[str], a) -> list[dict]:
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for rnd in range(a.rounds):
        for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            runs[i].append(_host_time(trees[i], a.iters, a.timeout, LAYER_HOST_TIME,
                                      ("--packed",) if a.layer_packed else ()))
    row: dict[str, Any] = dict(outputs_identical=len({r["outputs_sha256"] for r in runs[0] + runs[1]}) == 1,
                               packed=a.layer_packed)
    for key in ("layer_s", "ring_s", "glue_s") + (("first_layer_s", "first_glue_s") if a.layer_packed else ()):
        xa, xb = [r[key] for r in runs[0]], [r[key] for r in runs[1]]
        ratios = [b / x for x, b in zip(xa, xb)]
        row[key] = dict(a=statistics.median(xa), b=statistics.median(xb), ratio=statistics.median(ratios),
                        ratio_min=min(ratios), ratio_max=max(ratios), a_rounds=xa, b_rounds=xb)
        m = row[key]
        print(f"{key[:-2]:>11} fwd+bwd: {a.rev_a} {m['a'] * 1e3:.3f} ms  {a.rev_b} {m['b'] * 1e3:.3f} ms  ratio "
              f"{m['ratio']:.3f} ({m['ratio_min']:.3f}-{m['ratio_max']:.3f})", flush=True)
    print("layer outputs and gradients: " + ("bit-identical" if row["outputs_identical"] else "DIFFERENT"), flush=True)
    return [row]


def _plan_time_rows(trees: list[str], a) -> list[dict]:
    """``--plan-time`` (see the module doc)."""
    runs: dict[int, list[list[dict]]] = {0: [], 1: []}
    for rnd in range(a.rounds):
        for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            runs[i].append(_host_time(trees[i], a.iters, a.timeout, PLAN_TIME, ("--tiles",) if a.plan_tiles else ()))
    rows = []
    for n, first in enumerate(runs[0][0]):
        xa, xb = [r[n]["plan_ms"] for r in runs[0]], [r[n]["plan_ms"] for r in runs[1]]
        ratios = [b / x for x, b in zip(xa, xb)]
        row = {k: first[k] for k in ("P", "tokens_per_rank", "layout", "mix", "docs")}
        row.update(a_ms=statistics.median(xa), b_ms=statistics.median(xb), ratio=statistics.median(ratios),
                   ratio_min=min(ratios), ratio_max=max(ratios), a_rounds=xa, b_rounds=xb,
                   planned=(runs[0][0][n]["masked"], runs[0][0][n]["planned"], runs[1][0][n]["planned"]))
        rows.append(row)
        print(f"P={row['P']} {row['tokens_per_rank']:>5} per rank {row['layout']:>8} {row['mix']:>5} ({row['docs']:.0f} "
              f"docs): {a.rev_a} {row['a_ms']:.1f} ms  {a.rev_b} {row['b_ms']:.1f} ms  ratio {row['ratio']:.3f} "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}); masked tasks {row['planned'][0]}, planned "
              f"{row['planned'][1]} / {row['planned'][2]}", flush=True)
    return rows


GPU_WORKER = r"""
import json, sys, torch
from megatron_ring_lab.bench.gpu import gpu_row
cfg = json.loads(sys.argv[1])
for line in sys.stdin:
    p, t = json.loads(line)
    r = gpu_row(p, p * t, 32, 8, 128, torch.bfloat16 if cfg["device"] == "cuda" else torch.float32,
                iters=cfg["iters"], docs=cfg["docs"], device=cfg["device"])
    keys = ("efficiency", "host_ms", "ring_slowest_rank_ms", "one_device_ms", "launches",
            "reference_kernel_ms_attention")
    print("ROW " + json.dumps({k: v for k, v in r.items() if k in keys or k.startswith(("kernel_ms_", "host_ms_"))}),
          flush=True)
"""


def _gpu_rows(trees: list[str], a) -> list[dict]:
    """``--gpu-rows`` (see the module doc)."""
    sizes = [tuple(int(x) for x in s.split(":")) for s in a.gpu_sizes]
    cfg = json.dumps(dict(iters=a.iters, docs=a.gpu_docs, device=a.gpu_device))
    procs = []
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "lab"),
                                                           os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, "-c", GPU_WORKER, cfg], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir()))
    got: dict[tuple, list[dict]] = {(i, s): [] for i in (0, 1) for s in sizes}
    try:
        for rnd in range(a.rounds + 1):  # round 0: warm-up (compiles, caches), dropped
            for s in sizes:
                for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                    procs[i].stdin.write(json.dumps(s) + "\n")
                    procs[i].stdin.flush()
                    line = procs[i].stdout.readline()
                    while line and not line.startswith("ROW "):
                        line = procs[i].stdout.readline()
                    if not line:
                        raise RuntimeError(f"the GPU worker of {trees[i]} stopped (size {s})")
                    if rnd:
                        got[(i, s)].append(json.loads(line[4:]))
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)
    rows = []
    print(f"| P | tokens per rank | host ms {a.rev_a} / {a.rev_b} | efficiency {a.rev_a} / {a.rev_b} | launches | "
          "slowest rank B/A (spread) |\n|---|---|---|---|---|---|", flush=True)
    for s in sizes:
        ra, rb = got[(0, s)], got[(1, s)]
        med = lambda rows_, k: statistics.median(r[k] for r in rows_)  # noqa: E731
        ratios = [y["ring_slowest_rank_ms"] / x["ring_slowest_rank_ms"] for x, y in zip(ra, rb)]
        row = dict(P=s[0], tokens_per_rank=s[1], a=ra, b=rb, ratio=statistics.median(ratios), ratio_min=min(ratios),
                   ratio_max=max(ratios))
        rows.append(row)
        print(f"| {s[0]} | {s[1]} | {med(ra, 'host_ms'):.2f} / {med(rb, 'host_ms'):.2f} | {med(ra, 'efficiency'):.3f} "
              f"/ {med(rb, 'efficiency'):.3f} | {ra[0]['launches']} / {rb[0]['launches']} | {row['ratio']:.3f} "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) |", flush=True)
    _print_kinds(sizes, got, a, "kernel_ms_", "kernel GPU ms", "reference_kernel_ms_attention")
    _print_kinds(sizes, got, a, "host_ms_", "host ms")
    return rows


def _print_kinds(sizes: list[tuple], got: dict, a, prefix: str, what: str, reference: str | None = None) -> None:
    """Where a revision's rows carry a breakdown (the row's ``<prefix><kind>`` fields: the kernel GPU time by kind on
    CUDA, the host time by part): the slowest rank's call by kind, medians over rounds, each revision ("-": the
    revision reports none), and the ``reference`` field beside them (the one-GPU reference's attention kernels)."""
    kinds = [k.removeprefix(prefix) for k in next(
        (r for rows in got.values() for r in rows if any(k.startswith(prefix) and v is not None for k, v in r.items())),
        {}) if k.startswith(prefix)]
    if not kinds:
        return

    def by_kind(rows_: list[dict]) -> str:
        vals = [[r.get(prefix + k) for r in rows_] for k in kinds]
        return " / ".join("-" if None in v else f"{statistics.median(v):.2f}" for v in vals)
    print(f"\n{what} of the slowest rank's call by kind ({' / '.join(kinds)}):\n"
          f"| P | tokens per rank | {a.rev_a} | {a.rev_b} |" + (" reference attention |" if reference else "")
          + "\n|---|---|---|---|" + ("---|" if reference else ""), flush=True)
    for s in sizes:
        ra, rb = got[(0, s)], got[(1, s)]
        line = f"| {s[0]} | {s[1]} | {by_kind(ra)} | {by_kind(rb)} |"
        if reference:
            ref = [r[reference] for r in ra + rb if r.get(reference) is not None]
            line += f" {f'{statistics.median(ref):.2f}' if ref else '-'} |"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    ap.add_argument("--host-time", action="store_true", help="compare the engine's host time per ring step and "
                    "per call instead (lab/megatron_ring_lab/bench/host_time.py; --iters calls per P, default 200)")
    ap.add_argument("--layer-host-time", action="store_true", help="compare the host time of one Megatron "
                    "core-attention layer call, glue and engine (lab/megatron_ring_lab/bench/layer_host_time.py; "
                    "--iters calls, default 400)")
    ap.add_argument("--layer-packed", action="store_true", help="with --layer-host-time: a packed THD batch of "
                    "three documents, the later layers of a micro-batch (same params) and its first (new params)")
    ap.add_argument("--plan-time", action="store_true", help="compare the host time to plan a new document layout "
                    "(lab/megatron_ring_lab/bench/plan_time.py; --iters new mixes per row, default 5)")
    ap.add_argument("--plan-tiles", action="store_true", help="with --plan-time: the CPU engine's planning (tile "
                    "schedules) instead of the GPU's")
    ap.add_argument("--outputs", action="store_true", help="check that the two revisions' outputs and gradients "
                    "are bit-identical (OUTPUT_CASES) instead of timing")
    ap.add_argument("--gpu-rows", action="store_true", help="compare the GPU benchmark rows (a CUDA GPU; see the "
                    "module doc)")
    ap.add_argument("--gpu-sizes", nargs="+", default=["2:2048", "4:2048", "8:2048", "2:8192", "8:8192"],
                    help="--gpu-rows: P:tokens_per_rank per row")
    ap.add_argument("--gpu-docs", action="store_true", help="--gpu-rows: packed documents (a real length mix)")
    ap.add_argument("--gpu-device", default="cuda", help="--gpu-rows: cpu runs the same rows on CPU (fp32; a check "
                    "of the script, not a GPU figure)")
    ap.add_argument("--trees", nargs=2, metavar=("TREE_A", "TREE_B"), help="two prepared trees instead of git "
                    "revisions (rev_a, rev_b only name them)")
    a = ap.parse_args(argv)
    if a.host_time and a.iters == 3:
        a.iters = 200
    if a.layer_host_time and a.iters == 3:
        a.iters = 400
    if a.plan_time and a.iters == 3:
        a.iters = 5
    if a.gpu_rows and a.iters == 3:
        a.iters = 7
    with tempfile.TemporaryDirectory() as tmp:
        trees, made = [os.path.abspath(t) for t in a.trees] if a.trees else [], []
        if not trees:
            repo = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
            for i, rev in enumerate((a.rev_a, a.rev_b)):
                path = os.path.join(tmp, f"rev{i}")
                subprocess.check_call(["git", "-C", repo, "worktree", "add", "-q", "--detach", path, rev])
                made.append(path)
            trees = made
        try:
            rows = _host_time_rows(trees, a) if a.host_time else _output_rows(trees, a) if a.outputs else \
                _layer_host_time_rows(trees, a) if a.layer_host_time else _gpu_rows(trees, a) if a.gpu_rows else \
                _plan_time_rows(trees, a) if a.plan_time else []
            for world in ([] if a.host_time or a.outputs or a.layer_host_time or a.gpu_rows or a.plan_time
                          else a.world_sizes):
                for causal in (True, False):
                    cfg = dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, iters=a.iters, causal=causal)
                    t = {0: [], 1: []}
                    for rnd in range(a.rounds):
                        for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                            t[i].append(_run(trees[i], world, cfg, a.timeout))
                    ratios = [b / x for x, b in zip(t[0], t[1])]
                    row = dict(P=world, causal=causal, a_s=statistics.median(t[0]), b_s=statistics.median(t[1]),
                               ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                               a_rounds=t[0], b_rounds=t[1])
                    rows.append(row)
                    print(f"P={world} causal={causal!s:5}  {a.rev_a}: {row['a_s']:.3f} s  {a.rev_b}: {row['b_s']:.3f} s"
                          f"  ratio {row['ratio']:.3f} (rounds {row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
                          flush=True)
        finally:
            for path in made:
                subprocess.call(["git", "-C", repo, "worktree", "remove", "--force", path])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rev_a=a.rev_a, rev_b=a.rev_b, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
