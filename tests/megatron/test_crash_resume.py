"""Crashes lose nothing: a rank SIGKILLed in the middle of an iteration of Megatron-LM's pretrain() at CP = 4.

One test (slow; megatron.training, the Python 3.12 venv), four launches of tests/megatron/crash_worker.py
(examples/pretrain_ring_gpt_any_cp.py with a self-kill) on the tiny model of test_resume_cp.py, ITERS
iterations, a ``torch_dist`` checkpoint every SAVE_EVERY:

1. CP = 4 uninterrupted (the suite's launcher, ``tests/helpers/launch.py`` ``torchrun_cmd``): the reference curve.
2. CP = 4 under torchrun, global rank KILL_RANK SIGKILLed in the middle of iteration KILL_ITER (after its
   first micro-batch, before the optimizer step). The job must end (torchrun tears the others down) within
   END_BOUND_S of the kill: torchrun's grace period before SIGKILL (30 s) plus slack for a loaded machine,
   far below the ring's and Megatron's time-outs (set to CP_TIMEOUT_S and 10 minutes), so an end that waited
   for a time-out fails. The checkpoint directory's tracker (``latest_checkpointed_iteration.txt``) must
   name the last complete checkpoint (the last multiple of SAVE_EVERY before KILL_ITER), complete on disk,
   and nothing later may exist.
3. CP = 2 resumed from that tracker (``--load`` without ``--ckpt-step``; the suite's launcher): its per-iteration
   losses must continue the uninterrupted CP = 4 curve within the model-level bound ``i rel_fwd max(|loss|, 1)`` at
   iteration i (tests/helpers/numerics.py, as test_resume_cp.py: CP = 2 and 4 differ by reordering only).
4. CP = 4 with the ranks started directly (one process per rank, as under Slurm; no torchrun teardown; each forked
   from the suite's fork server through ``forkrun.py --exec`` where there is one, as the workers in 2),
   the same kill, ring time-out DIRECT_TIMEOUT_S: every surviving rank must raise a named error
   (``RingPeerError`` naming the killed global rank: the first collective after the kill is the ring's
   cross-rank check, then the ring itself) and exit non-zero within DIRECT_TIMEOUT_S plus
   start/teardown slack of the kill; none may hang. Strays (the multiprocessing manager megatron-core's
   checkpoint writer spawns, orphaned by a SIGKILLed rank) are reported and killed, as a scheduler would.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from tests.helpers.launch import JOB_PRELOAD, served, torchrun_cmd
from tests.helpers.numerics import model_loss_tol
from tests.megatron.pretrain_cli import CPU_FLAGS, MODEL_SIZES, PRETRAIN_MARKS, free_port, gpt_args

pytestmark = PRETRAIN_MARKS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron", "crash_worker.py")
ITERS, SAVE_EVERY, KILL_ITER, KILL_RANK = 4, 2, 3, 2
MICRO_BATCHES = 2  # global batch 4 / (micro batch 2 x DP 1)
KILL_AT = MICRO_BATCHES * (KILL_ITER - 1) + 2  # the second micro-batch of KILL_ITER: mid-iteration
CP_TIMEOUT_S = 300.0  # the ring's time-out under torchrun: an end that waited for it exceeds END_BOUND_S
END_BOUND_S = 30.0 + 15.0  # torchrun's SIGTERM -> SIGKILL grace, plus slack
DIRECT_TIMEOUT_S = 20.0
DIRECT_SLACK_S = 30.0  # interpreter teardown of a failed rank on a loaded 2-core machine
LAUNCH_TIMEOUT_S = 600.0
MODEL = gpt_args(ITERS, attention_dropout=0.1, extra="--ckpt-format torch_dist --distributed-timeout-minutes 10")


def _env(tmp_path, name: str, kill: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MEGATRON_RING_LOSS_LOG=str(tmp_path / f"{name}.loss"))
    if kill:
        env.update(MEGATRON_RING_TEST_KILL_RANK=str(KILL_RANK), MEGATRON_RING_TEST_KILL_AT=str(KILL_AT),
                   MEGATRON_RING_TEST_KILL_NOTE=str(tmp_path / f"{name}.killed"))
    return env


def _args(cp: int, ckpt, timeout_s: float, *extra: str) -> list[str]:
    return [*MODEL, *CPU_FLAGS, "--context-parallel-size", str(cp), "--cp-timeout-seconds", str(timeout_s), *extra]


def _strays(marker: str, workdir) -> list[str]:
    """Processes of a finished job still alive, SIGKILLed as a scheduler ends a job: e.g. the multiprocessing
    manager of megatron-core's checkpoint writer, orphaned when its rank is SIGKILLed. Found by ``marker``, a path only
    that job's environment holds, or by their working directory ``workdir``, the job's own: a process forked from the
    suite's fork server shows the server's environment in /proc, not the job's."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read() and os.readlink(f"/proc/{pid}/cwd") != str(workdir):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode()[:100])
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    return found


def _workdir(tmp_path, name: str):
    """The job's working directory, its own (how :func:`_strays` tells its processes)."""
    path = tmp_path / f"{name}.cwd"
    path.mkdir(exist_ok=True)
    return path


def _worker() -> list[str]:
    """What a launcher starts per rank: the worker, forked from the suite's fork server where there is one
    (``forkrun.py --exec``: the agent's signals reach it and its death by a signal is the process's; its imports
    done once, and Megatron's checkpoint writer's Manager forked from it, tests/helpers/ckpt_queue.py), else a
    fresh interpreter."""
    return served(WORKER, preload=JOB_PRELOAD)


def _torchrun(tmp_path, name: str, cp: int, ckpt, *extra: str, kill: bool = False):
    """One torchrun job (output in files: a stray holding a pipe could block the wait): (exit code, end time,
    stderr, strays). Only the killed job tests torchrun itself (its agent, rendezvous and teardown; the workers as
    :func:`_worker` starts them); the others run under ``torchrun_cmd`` (the suite's fork launcher without CUDA: the
    ranks share one import of torch and Megatron)."""
    args = _args(cp, ckpt, CP_TIMEOUT_S, *extra)
    env = _env(tmp_path, name, kill)
    if kill:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *_worker(), *args]
    else:
        cmd = torchrun_cmd(WORKER, cp, *args)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    workdir = _workdir(tmp_path, name)
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=workdir)
        try:
            code = p.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.time()
        strays = _strays(str(tmp_path / f"{name}.loss"), workdir)
    assert code is not None, f"{name}: still running after {LAUNCH_TIMEOUT_S:.0f} s (a hang); strays {strays}"
    return code, ended, (tmp_path / f"{name}.err").read_text(), strays


def _losses(tmp_path, name: str) -> list[float]:
    rows = [tuple(map(float, line.split()[:2])) for line in (tmp_path / f"{name}.loss").read_text().splitlines()]
    assert len(rows) % MICRO_BATCHES == 0, rows
    return [sum(r[0] for r in rows[i:i + MICRO_BATCHES]) / sum(r[1] for r in rows[i:i + MICRO_BATCHES])
            for i in range(0, len(rows), MICRO_BATCHES)]


def _direct(tmp_path, name: str, cp: int, ckpt, *extra: str) -> tuple[list[tuple[int, float, str]], list[str]]:
    """One process per rank (no torchrun): per rank (exit code, exit time, stderr), and the strays."""
    port, env = free_port(), _env(tmp_path, name, kill=True)
    workdir = _workdir(tmp_path, name)
    procs = []
    for r in range(cp):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(cp), LOCAL_WORLD_SIZE=str(cp),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(tmp_path / f"{name}.rank{r}.err", "w") as err:
            p = subprocess.Popen([sys.executable, *_worker(), *_args(cp, ckpt, DIRECT_TIMEOUT_S, *extra)], env=e,
                                 stdout=subprocess.DEVNULL, stderr=err, cwd=workdir)
        procs.append(p)
    ended: dict[int, float] = {}
    deadline = time.time() + LAUNCH_TIMEOUT_S
    while len(ended) < cp and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.1)
    hung = [r for r in range(cp) if r not in ended]
    strays = _strays(str(tmp_path / f"{name}.loss"), workdir)
    out = [(p.returncode, ended.get(r, math.inf), (tmp_path / f"{name}.rank{r}.err").read_text())
           for r, p in enumerate(procs)]
    assert not hung, f"ranks {hung} still running {LAUNCH_TIMEOUT_S:.0f} s after the start: a hang"
    return out, strays


def test_sigkill_mid_iteration_loses_nothing(tmp_path):
    last_complete = (KILL_ITER - 1) // SAVE_EVERY * SAVE_EVERY
    assert last_complete > 0

    # 1. the uninterrupted CP = 4 curve
    code, _, err, _ = _torchrun(tmp_path, "full", 4, None)
    assert code == 0, err[-5000:]
    full = _losses(tmp_path, "full")
    assert len(full) == ITERS, full

    # 2. CP = 4 under torchrun, a rank SIGKILLed mid-iteration
    ckpt = tmp_path / "ckpt"
    code, ended, err, strays = _torchrun(tmp_path, "killed", 4, ckpt, "--save", str(ckpt), "--save-interval",
                                         str(SAVE_EVERY), kill=True)
    killed_at = float((tmp_path / "killed.killed").read_text())
    print(f"\ntorchrun: the job ended {ended - killed_at:.2f} s after the kill (rc {code}); strays: {strays}")
    assert code != 0, "the job must fail when a rank is killed"
    assert ended - killed_at < END_BOUND_S, f"the job ended {ended - killed_at:.1f} s after the kill"
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == str(last_complete), (tracker, sorted(os.listdir(ckpt)))
    saved = ckpt / f"iter_{last_complete:07d}"
    files = set(os.listdir(saved))  # torch_dist: metadata, and one shard file per writing rank
    assert {".metadata", "metadata.json"} <= files and sum(f.endswith(".distcp") for f in files) == 4, sorted(files)
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == \
        [f"iter_{i:07d}" for i in range(SAVE_EVERY, last_complete + 1, SAVE_EVERY)], sorted(os.listdir(ckpt))

    # 3. resumed at CP = 2 from what the tracker names
    code, _, err, _ = _torchrun(tmp_path, "resumed", 2, ckpt, "--load", str(ckpt), "--exit-on-missing-checkpoint")
    assert code == 0, err[-5000:]
    got, want = _losses(tmp_path, "resumed"), full[last_complete:]
    assert len(got) == ITERS - last_complete, got
    tols = [model_loss_tol(b, step=last_complete + 1 + i, **MODEL_SIZES) for i, b in enumerate(want)]
    assert all(abs(a - b) <= t for a, b, t in zip(got, want, tols)), (got, want, tols)

    # 4. ranks started directly: every survivor raises a named error within its time-out and exits
    ranks, strays = _direct(tmp_path, "direct", 4, None)
    killed_at = float((tmp_path / "direct.killed").read_text())
    print("ranks started directly: seconds from the kill to each rank's exit, exit codes:",
          [(round(ended - killed_at, 2), code) for code, ended, _ in ranks], "strays:", strays)
    for r, (code, ended, err) in enumerate(ranks):
        if r == KILL_RANK:
            assert code == -9, (r, code)
            continue
        assert code not in (0, None), (r, code, err[-3000:])
        named = [line for line in err.splitlines() if "RingPeerError:" in line]
        # the failure notes name the lost rank (among the suspects when a neighbour's note came too late)
        assert named and re.search(rf"global ranks? (\d+, )*{KILL_RANK}\b", named[-1]), (r, named, err[-3000:])
        assert ended - killed_at < DIRECT_TIMEOUT_S + DIRECT_SLACK_S, (r, ended - killed_at, err[-2000:])
