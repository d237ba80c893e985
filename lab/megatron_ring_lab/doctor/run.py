"""Launch one training run per CP size (subprocesses: torchrun, or without CUDA the fork launcher) and load what
each rank recorded."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_ring_lab import forkrun
from megatron_ring_lab.doctor.capture import OUT_ENV

#: the spec every run gets (core attention = the ring at every CP size, CP=1 included)
SPEC = ["--spec", "megatron_ring.megatron.spec", "ring_layer_spec"]
#: environment variables that change only runs at CP > 1: a CP=1 run is reused across them (``--cache``)
CP1_NEUTRAL_ENV = {"MEGATRON_RING_MTP_CP_INVARIANT", "MEGATRON_RING_COMM_DTYPE", "MEGATRON_RING_CP_COMM_TYPE",
                   "MEGATRON_RING_KV_PIECES"}


@dataclass
class Run:
    """One run: its CP size, its folder, its exit status and what each rank recorded."""
    cp: int
    folder: str
    returncode: int = 0
    seconds: float = 0.0
    log_tail: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.ranks)


#: runs of one CP size whose rendezvous port another process took first (EADDRINUSE), at most
PORT_TRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script: str, args: list[str], cp: int, pp: int = 1, fork: bool = False) -> list[str]:
    """``torchrun --nproc-per-node cp*pp -m megatron_ring_lab.doctor.entry SCRIPT ARGS --context-parallel-size cp``;
    ``fork``: the same job from :mod:`megatron_ring_lab.forkrun` (torch and Megatron imported once, then the ranks
    forked: a CPU run starts in seconds instead of every rank importing them; it reads MASTER_ADDR / MASTER_PORT
    from the environment, see :func:`launch`)."""
    spec = [] if "--spec" in args else SPEC
    job = ["-m", "megatron_ring_lab.doctor.entry", script, *for_cp(args, cp), "--context-parallel-size", str(cp),
           *spec]
    if fork:
        return forkrun.command(cp * pp, *job)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp * pp), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *job]


def for_cp(args: list[str], cp: int) -> list[str]:
    """``args`` for a run at CP = ``cp``: the CP = 1 reference leaves out the hierarchical CP sizes (Megatron
    asserts that their product is the CP size) and runs p2p (one rank: every comm type computes the same)."""
    if cp != 1 or "--hierarchical-context-parallel-sizes" not in args:
        return list(args)
    from megatron_ring_lab.doctor.shrink import Args

    a = Args(args)
    a.drop("--hierarchical-context-parallel-sizes")
    if a.has("--cp-comm-type"):
        a.set("--cp-comm-type", "p2p")
    return a.argv()


def cache_key(script: str, args: list[str], cp: int, env: dict[str, str]) -> str:
    """Script and recorder content, arguments, CP size and the MEGATRON_RING_* environment (less the
    CP>1-only ones at CP=1)."""
    from megatron_ring_lab.doctor import capture

    h = hashlib.sha256()
    for path in (script, capture.__file__):  # the script and what the recorders write
        with open(path, "rb") as f:
            h.update(f.read())
    ring_env = {k: v for k, v in sorted(env.items()) if k.startswith("MEGATRON_RING_") and k != OUT_ENV
                and not (cp == 1 and k in CP1_NEUTRAL_ENV)}
    h.update(json.dumps([os.path.abspath(script), args, cp, ring_env]).encode())
    return h.hexdigest()[:16]


def load(folder: str) -> list[dict[str, Any]]:
    import torch

    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".pt"):
            out.append(torch.load(os.path.join(folder, name), weights_only=False))
    return sorted(out, key=lambda r: r["meta"]["rank"])


def launch(script: str, args: list[str], cp: int, workdir: str, *, pp: int = 1, timeout_s: float = 900.0,
           cache: str | None = None, progress: Callable[[str], None] = print) -> Run:
    """Run SCRIPT at this CP size; ``cache``: a folder where finished CP=1 (reference) runs are kept and
    reused by key (CP > 1 runs always run)."""
    env = dict(os.environ)
    key = cache_key(script, args, cp, env)
    cache = cache if cp == 1 else None
    if cache:
        kept = os.path.join(cache, f"cp{cp}-{key}")
        if os.path.isfile(os.path.join(kept, "done.json")):
            run = Run(cp, kept, ranks=load(kept), cached=True,
                      seconds=json.load(open(os.path.join(kept, "done.json")))["seconds"])
            progress(f"[doctor] CP={cp}: reused {kept} ({run.seconds:.0f} s when it ran)")
            return run
    folder = os.path.join(workdir, f"cp{cp}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    env[OUT_ENV] = folder
    env.setdefault("OMP_NUM_THREADS", "1")
    import torch

    fork = not torch.cuda.is_available()  # a forked rank could not use CUDA
    progress(f"[doctor] CP={cp}: running {cp * pp} process(es) ...")
    t0 = time.perf_counter()
    for attempt in range(PORT_TRIES):
        # a free port is only free when asked: another process may take it before rank 0 listens on it
        # (EADDRINUSE); then the job runs again on another one
        if fork:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = command(script, args, cp, pp, fork=fork)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, tail = p.returncode, (p.stdout[-4000:] + "\n" + p.stderr[-6000:])
        except subprocess.TimeoutExpired as e:
            rc = 124
            tail = f"timed out after {timeout_s:.0f} s\n" + str(e.stdout or "")[-2000:] + str(e.stderr or "")[-3000:]
        if rc == 0 or "EADDRINUSE" not in tail or attempt + 1 == PORT_TRIES:
            break
        progress(f"[doctor] CP={cp}: the rendezvous port was taken meanwhile (EADDRINUSE): running again")
    secs = time.perf_counter() - t0
    with open(os.path.join(folder, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + tail)
    run = Run(cp, folder, rc, secs, tail, load(folder) if rc == 0 else [])
    if rc == 0 and len(run.ranks) != cp * pp:
        run.returncode, run.ranks = 3, []
        run.log_tail += f"\n[doctor] {cp * pp} processes ran but {len(os.listdir(folder)) - 1} wrote a record " \
                        "(did the script call Megatron-LM's pretrain()?)"
    progress(f"[doctor] CP={cp}: {'done' if run.ok else f'FAILED (exit {rc})'} in {secs:.0f} s")
    if cache and run.ok:
        kept = os.path.join(cache, f"cp{cp}-{key}")
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(folder, kept)
        with open(os.path.join(kept, "done.json"), "w") as f:
            json.dump({"seconds": secs}, f)
    return run
