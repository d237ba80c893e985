"""A torchrun stand-in for single-node CPU jobs (the suite's, the doctor's), without the per-rank start-up cost:

    python lab/megatron_ring_lab/forkrun.py NPROC PRELOAD SCRIPT [ARGS...]
    python lab/megatron_ring_lab/forkrun.py NPROC PRELOAD -m MODULE [ARGS...]

imports the comma-separated modules of PRELOAD once (one that is not installed is skipped), then forks NPROC
ranks, each running SCRIPT (or MODULE) as ``__main__`` (``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS``
or ``python -m MODULE ARGS`` sets them)
with the environment torchrun gives a single-node job: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, GROUP_WORLD_SIZE, and MASTER_ADDR / MASTER_PORT from the caller (rank 0
hosts the rendezvous store, as ``init_process_group("env://")`` does without an agent). Under torchrun every
rank imports torch, Megatron and the glue itself (about 6 s of CPU each on a 2-core machine, 4 ranks per job):
here the ranks share the parent's imports, copy-on-write. Ranks end through the interpreter's normal shutdown.

Exit code: 0 when every rank exits 0; else 1, once the first failing rank is reported, the others are sent
SIGTERM and, GRACE_S later, SIGKILL (torchrun's order). A rank dies with this process (PR_SET_PDEATHSIG), so a
caller's time-out that kills it leaves no stray rank. Only for machines without CUDA (``tests/helpers/launch.py``
and the doctor's launcher pick it there): a module that initialises CUDA at import would leave forked ranks unable
to use it. It imports nothing of this package (run by its path).
"""
from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import signal
import sys
import time

GRACE_S = 30.0  # torchrun's SIGTERM -> SIGKILL grace
#: what a Megatron job imports before its ranks fork (a module that is not installed is skipped)
PRELOAD = ("torch,torch.distributed,megatron.core,megatron.training,megatron.training.training,"
           "megatron.core.models.gpt,megatron.core.models.gpt.gpt_layer_specs,megatron.core.models.mamba,"
           "megatron_ring.megatron")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a killed launcher may leave ranks behind, as torchrun's may
        pass


def _run_rank(rank: int, nproc: int, script: str, args: list[str]) -> None:
    """In the forked child: torchrun's environment, then the script as __main__; never returns."""
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1")
    code = 0
    try:
        if script == "-m":  # python -m MODULE ARGS: the working directory first on sys.path
            sys.argv, sys.path[0] = [args[0], *args[1:]], os.getcwd()
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (reported like an uncaught exception, exit code 1)
        import traceback
        traceback.print_exc()
        code = 1
    sys.exit(code)  # the interpreter's normal shutdown (atexit, buffered files flushed), as under torchrun


def command(nproc: int, *job: str, preload: str = PRELOAD) -> list[str]:
    """The command line of a job of ``nproc`` ranks: ``job`` is ``SCRIPT ARGS`` or ``-m MODULE ARGS``; the caller's
    environment must carry MASTER_ADDR / MASTER_PORT."""
    return [sys.executable, os.path.abspath(__file__), str(nproc), preload, *map(str, job)]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or (argv[2] == "-m" and len(argv) < 4):
        print(__doc__, file=sys.stderr)
        return 2
    nproc, preload, script, args = int(argv[0]), argv[1], argv[2], argv[3:]
    for name in filter(None, preload.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, nproc, script, args)
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            print(f"[forkrun] rank {rank} exited with {code}: terminating the others", file=sys.stderr, flush=True)
            _stop(pids)
    return 0 if failed is None else 1


def _stop(pids: dict) -> None:
    """SIGTERM the ranks still running, then SIGKILL those alive GRACE_S later; reaps them (``pids`` emptied)."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        for pid in [pid for pid in pids if os.waitpid(pid, os.WNOHANG)[0] == pid]:
            del pids[pid]
        time.sleep(0.1)
    for pid in list(pids):
        _signal(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        del pids[pid]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
