"""Launch one torchrun per "host" (network namespace) and collect what every rank recorded.

:func:`run_job` starts ``torchrun --nnodes N --node-rank i --nproc-per-node P --master-addr <host 0>``
inside each namespace with ``GLOO_SOCKET_IFNAME`` set to that namespace's veth, runs
``tests/multinode/mn_driver.py`` (examples/train_gpt.py + fault injection), and returns a :class:`Job`
with each node's exit code and exit time, its log, and each rank's record. Every run has a hard deadline;
on teardown the whole process group of each torchrun and every process left in the namespaces is killed.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from netns import Host

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DRIVER = os.path.join(HERE, "mn_driver.py")
_ports = itertools.count(29500)  # namespaces are private network stacks: every port is free in them

#: quieter C++ logs (the "hostname of the client socket cannot be retrieved" warnings: no reverse DNS here)
QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
#: hard deadline of one torchrun job (seconds); override with MN_JOB_TIMEOUT_S
JOB_TIMEOUT = float(os.environ.get("MN_JOB_TIMEOUT_S", "180"))

#: a small GPT run: 2 layers, hidden 64, seq 128, a few steps
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups",
               "2", "--seq-length", "128", "--micro-batch-size", "1", "--threads", "1"]


@dataclass
class Job:
    nodes: list[dict]  # per node: rc, t_exit, log (stdout+stderr), timed_out
    ranks: dict[int, dict]  # rank -> record written by mn_driver
    summary: dict | None  # rank 0's --log-json (None if rank 0 did not finish)
    t_start: float
    t_fault: float | None = None  # when the harness took a node down (node faults)
    out: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.summary["log"]] if self.summary else []

    def log(self) -> str:
        return "\n".join(f"--- node {i} rc={n['rc']} ---\n{n['log'][-6000:]}" for i, n in enumerate(self.nodes))


def _node_env(host: Host, master: Host, out: str, env: dict[str, str]) -> dict[str, str]:
    e = dict(os.environ)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME",
              "TORCHELASTIC_RUN_ID", "MN_FAULT", "MN_RANK_ARGS"):
        e.pop(k, None)
    e.update(GLOO_SOCKET_IFNAME=host.ifname, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MN_OUT=out,
             PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
             PYTHONWARNINGS="ignore")
    e.update(env)
    return e


def run_job(hosts: list[Host], out: str, train_args: list[str], *, nproc: int = 2, env: dict | None = None,
            node_fault: int | None = None, link_down: bool = True, timeout: float = 180.0) -> Job:
    """Run the driver on every host in ``hosts`` (host 0 is the rendezvous master).

    ``node_fault``: index of the host to take down when a rank writes ``fault_marker`` (an ``MN_FAULT``
    of kind ``stop``): its veth is set down first (so peers see no FIN/RST, as with a crashed machine),
    then every process in that namespace is SIGKILLed. ``link_down=False``: only the SIGKILL (the kernel
    still closes the dead processes' connections, so peers see FIN/RST at once).
    """
    os.makedirs(out, exist_ok=True)
    for fn in os.listdir(out):
        os.unlink(os.path.join(out, fn))
    master, port = hosts[0], next(_ports)
    procs, logs = [], []
    t_start = time.time()
    for i, h in enumerate(hosts):
        cmd = h.exec_prefix() + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--node-rank", str(i),
            "--nproc-per-node", str(nproc), "--master-addr", master.addr, "--master-port", str(port),
            "--monitor-interval", "0.1", DRIVER, *train_args]
        log = open(os.path.join(out, f"node{i}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=_node_env(h, master, out, env or {}), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))
    t_exit: list[float | None] = [None] * len(hosts)
    timed_out = [False] * len(hosts)
    t_fault = None
    deadline = time.monotonic() + timeout
    marker = os.path.join(out, "fault_marker")
    try:
        while any(t is None for t in t_exit):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if t_exit[i] is None and p.poll() is not None:
                    t_exit[i] = time.time()
            if node_fault is not None and t_fault is None and os.path.exists(marker):
                victim = hosts[node_fault]
                if link_down:
                    victim.set_link(False)  # the machine drops off the network ...
                t_fault = time.time()
                victim.kill_all(signal.SIGKILL)  # ... and everything on it dies
            if now > deadline:
                for i, p in enumerate(procs):
                    if t_exit[i] is None:
                        timed_out[i] = True
                        _kill_tree(p, hosts[i])
                        p.wait(timeout=30)
                        t_exit[i] = time.time()
                break
            time.sleep(0.05)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                _kill_tree(p, hosts[i])
                p.wait(timeout=30)
        for h in hosts:  # anything still in the namespaces (orphaned workers)
            h.kill_all(signal.SIGKILL)
        if node_fault is not None and t_fault is not None and link_down:
            hosts[node_fault].set_link(True)
    nodes = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        nodes.append(dict(rc=p.returncode, t_exit=t_exit[i], log=log.read(), timed_out=timed_out[i]))
        log.close()
    ranks = {}
    for fn in os.listdir(out):
        if fn.startswith("rank") and fn.endswith(".json"):
            with open(os.path.join(out, fn)) as f:
                rec = json.load(f)
            ranks[rec["rank"]] = rec
    summary = None
    path = os.path.join(out, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    return Job(nodes=nodes, ranks=ranks, summary=summary, t_start=t_start, t_fault=t_fault, out=out)


def _kill_tree(p: subprocess.Popen, host: Host) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    host.kill_all(signal.SIGKILL)


def train_args(*, tp: int = 1, cp: int = 1, steps: int = 3, extra: list[str] | None = None,
               out: str | None = None) -> list[str]:
    a = SMALL_MODEL + ["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
                       "--train-iters", str(steps)]
    if out:
        a += ["--log-json", os.path.join(out, "summary.json")]
    return a + list(extra or [])
