"""Launch one torchrun per "host" (network namespace) and collect what every rank recorded.

:func:`run_job` starts ``torchrun --nnodes N --node-rank i --nproc-per-node P --master-addr <host 0>``
inside each namespace with ``GLOO_SOCKET_IFNAME`` set to that namespace's veth, runs
``tests/multinode/mn_driver.py`` (examples/train_gpt.py + fault injection), and returns a :class:`Job`
with each node's exit code and exit time, its log, and each rank's record. Every run has a hard deadline;
on teardown the whole process group of each torchrun and every process left in the namespaces is killed.

Where :func:`start_fork_servers` started a fork server for a host (tests/multinode/conftest.py does, once per
session), that host's torchrun starts each worker as ``forkrun.py --exec PRELOAD mn_driver.py ...``
(lab/megatron_ring_lab/forkrun.py): the worker is forked from a process that imported torch, Megatron and the glue
once, instead of importing them again (7.9 s of CPU per worker, measured); it runs in the host's namespace, gets the
agent's signals and reports a death by signal as its own, so torchrun sees the worker it would have started. The
agents are started as before.
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

from megatron_ring_lab import forkrun

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


#: host namespace -> (socket, log path) of its fork server (:func:`start_fork_servers`)
FORK_SERVERS: dict[str, tuple[str, str]] = {}


@dataclass
class Job:
    nodes: list[dict]  # per node: rc, t_exit, log (stdout+stderr), timed_out
    ranks: dict[int, dict]  # rank -> record written by mn_driver
    summary: dict | None  # rank 0's --log-json (None if rank 0 did not finish)
    t_start: float
    t_fault: float | None = None  # when the harness took a node down (node faults)
    out: str = ""
    extra: dict = field(default_factory=dict)
    forked: int = 0  # workers forked by the hosts' fork servers (the rest imported as fresh processes)

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
    served = FORK_SERVERS.get(host.ns)
    if served:
        e[forkrun.SERVER_VARIABLE] = served[0]
    return e


def start_fork_servers(hosts: list[Host], where: str, timeout: float = 180.0) -> list:
    """One fork server per host (in the machine's own namespace: each job's supervisor enters the client's; a server
    per host because each host's GLOO_SOCKET_IFNAME differs), with the environment of that host's jobs; returns the
    ``Popen`` objects once each has imported (a server that fails to is left out: its host's workers import as
    before). The servers die with this process."""
    procs = []
    for h in hosts:
        path, log_path = os.path.join(where, f"fork-{h.index}.sock"), os.path.join(where, f"fork-{h.index}.log")
        with open(log_path, "w") as log:
            proc = forkrun.start_server(path, log, _node_env(h, hosts[0], where, QUIET_ENV))
        procs.append((h, proc, path, log_path))
    deadline = time.monotonic() + timeout
    started = []
    for h, proc, path, log_path in procs:
        while proc.poll() is None and time.monotonic() < deadline:
            with open(log_path) as f:
                if "imported" in f.read():  # its first line, once PRELOAD is in
                    FORK_SERVERS[h.ns] = (path, log_path)
                    break
            time.sleep(0.2)
        started.append(proc)
    return started


def stop_fork_servers(procs: list) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(30)
    FORK_SERVERS.clear()


def _decisions() -> dict[str, list[str]]:
    """Per host namespace, its fork server's decision lines so far (one per job: ``runs`` or ``refused``)."""
    out = {}
    for ns, (_, log_path) in FORK_SERVERS.items():
        with open(log_path) as f:
            out[ns] = [line for line in f if line.startswith("[forkrun server] r")]
    return out


def _forked(before: dict[str, list[str]]) -> int:
    """Workers the fork servers ran since ``before`` (:func:`_decisions`) was taken."""
    return sum(line.startswith("[forkrun server] runs")
               for ns, lines in _decisions().items() for line in lines[len(before.get(ns, ())):])


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
    before = _decisions()
    t_start = time.time()
    for i, h in enumerate(hosts):
        # the interpreter is torchrun's to add: forkrun's command without it
        worker = (forkrun.command(forkrun.EXEC, DRIVER)[1:] if h.ns in FORK_SERVERS else [DRIVER])
        cmd = h.exec_prefix() + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--node-rank", str(i),
            "--nproc-per-node", str(nproc), "--master-addr", master.addr, "--master-port", str(port),
            "--monitor-interval", "0.1", *worker, *train_args]
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
    return Job(nodes=nodes, ranks=ranks, summary=summary, t_start=t_start, t_fault=t_fault, out=out,
               forked=_forked(before))


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
