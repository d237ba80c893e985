"""Suite-wide settings.

Multi-process tests start their workers from megatron_ring_lab.launch's fork server (torch imported once
instead of once per worker); on a machine without CUDA it also imports Megatron-Core and the glue once,
so the Megatron tests' workers start in milliseconds too (a module that is not installed is skipped by
the server). With CUDA only torch is preloaded: a module that touched CUDA at import would leave the
server's forked workers unable to use it.
Jobs the tests start with torchrun's environment (tests/helpers/launch.py ``torchrun``) likewise fork their ranks
from one process that imported torch + Megatron + the glue once (lab/megatron_ring_lab/forkrun.py; torchrun itself
with CUDA), and that process is itself forked from one server per pytest process (below), which imported them once
for the whole session. The doctor's CLI runs (tests/helpers/launch.py ``python_cmd``) and the workers of the torchrun
jobs that test torchrun itself (tests/megatron/test_crash_resume.py) come from that server too, one process each
(``forkrun.py --exec``).
"""
import os
import pathlib
import sys

import torch

# The lab (lab/megatron_ring_lab: launcher, CPU harness, doctor, benchmark) from this checkout, also where it is
# not installed (scripts/setup_env.sh installs it editable into the test venvs).
_LAB = str(pathlib.Path(__file__).resolve().parents[1] / "lab")
if _LAB not in sys.path:
    sys.path.insert(1, _LAB)

from tests.helpers.launch import CKPT_QUEUE, JOB_PRELOAD  # noqa: E402 (the lab on sys.path first)

# The benchmarks launch their workers as fresh spawned processes so that glibc reads their MALLOC_* settings at start
# (their memory columns); the tests check the benchmarks' plumbing, not those figures, so their workers come from
# the fork server too (a spawned worker imports torch again: ~8 s per launch on a 2-core machine).
os.environ.setdefault("MEGATRON_RING_START_METHOD", "forkserver")

# One intra-op thread per test process where the caller set none (OMP_NUM_THREADS): the suite runs a pytest-xdist
# worker per core, and jobs of several ranks, so torch's default (a thread per core in every process) only made
# threads wait on each other. An idle OpenMP thread spins before it sleeps, taking the core another process needed:
# with two threads, tests/test_max_logit.py + tests/test_masks.py took 55-92 s of CPU against 28 s with one
# (2 cores). Set in the environment too, before any worker, rank or subprocess starts, so they inherit it.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    from megatron_ring_lab.forkrun import GLUE

    os.environ.setdefault("MEGATRON_RING_PRELOAD", "megatron.core.models.gpt,"
                                                   f"megatron.core.models.gpt.gpt_layer_specs,{GLUE}"
                          # the Bridge run of scripts/test.sh: Bridge's modules too (tests/megatron/bridge_preload.py)
                          + (",tests.megatron.bridge_preload"
                             if os.environ.get("MEGATRON_RING_TEST_PRELOAD_BRIDGE") == "1" else "")
                          # Megatron's checkpoint writer's results queue from a forked Manager (tests/helpers/ckpt_queue.py)
                          + f",{CKPT_QUEUE}")


# --- the fast tier: a test that starts processes must be marked slow --------------------------------------
# `pytest -m "not slow"` is the fast tier (scripts/test.sh runs it first). Every start of a worker process
# (multiprocessing, as the launcher's fork server does) or of a Python / torchrun subprocess is counted per
# test (its fixtures' setup included); a test that started any and is not marked `slow` errors at teardown.
import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402
import pytest  # noqa: E402

_STARTS = [0]


def _counting_process_start(orig):
    def start(self, *args, **kwargs):
        _STARTS[0] += 1
        return orig(self, *args, **kwargs)
    return start


def _starts_python(args) -> bool:
    """Whether a subprocess command runs Python or torchrun: a word (a shell string's too) whose program name
    starts with ``python`` or is ``torchrun``. Other programs do not count, also where they live under a Python
    install (Triton's ``.../python3.12/site-packages/triton/.../ptxas``, run when a kernel is compiled)."""
    if isinstance(args, bytes):
        args = args.decode(errors="replace")
    words = args.split() if isinstance(args, str) else [str(w) for w in args]
    for w in words:
        w = w.strip("'\"")
        name = os.path.basename(w)
        if w == sys.executable or name.startswith("python") or name == "torchrun":
            return True
    return False


def _counting_popen_init(orig):
    def __init__(self, args, *rest, **kwargs):
        if _starts_python(args):
            _STARTS[0] += 1
        return orig(self, args, *rest, **kwargs)
    return __init__


multiprocessing.process.BaseProcess.start = _counting_process_start(multiprocessing.process.BaseProcess.start)
subprocess.Popen.__init__ = _counting_popen_init(subprocess.Popen.__init__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _STARTS[0] = 0
    _serial_on_a_worker(item)  # defined below, with SERIAL
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the fixtures' teardown first, then the check (an error of this test's teardown phase)
    started, _STARTS[0] = _STARTS[0], 0
    # tests/gpu: run by scripts/gpu_check.sh on a GPU only, never in the fast tier (without a GPU they skip);
    # there the first Triton compile of a process starts helper processes
    if started and item.get_closest_marker("slow") is None and not item.nodeid.startswith("tests/gpu/"):
        pytest.fail(f"{item.nodeid} started {started} process(es) but is not marked slow: add "
                    "@pytest.mark.slow (multi-process tests are not in the fast tier, -m 'not slow')", pytrace=False)


# --- tests that run alone ---------------------------------------------------------------------------------
# scripts/test.sh runs each tier in two parts: `-m "... and not serial"` on two pytest-xdist workers, then
# `-m "... and serial"` in one process. Serial: tests that assert wall-clock bounds (a fault must be reported
# before a time-out; a slow peer must not fail) and tests that hold one machine-wide resource (the multi-node
# tests' fixed network namespaces, the GPU), which a second test beside them would skew or collide with.
SERIAL = ("tests/multinode/", "tests/gpu/", "tests/test_faults.py::", "tests/test_bad_input_everywhere.py::",
          "tests/test_strategy_features.py::test_bad_input_on_one_rank_raises_on_every_rank_for_every_comm_type")


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


def _serial_on_a_worker(item) -> None:
    """A serial test that reached a pytest-xdist worker runs beside another test: it fails, naming the fix."""
    if os.environ.get("PYTEST_XDIST_WORKER") and item.get_closest_marker("serial") is not None:
        pytest.fail(f"{item.nodeid} is marked serial (tests/conftest.py SERIAL) but runs on a pytest-xdist worker: "
                    "run it without -n, or deselect it there with -m 'not serial'", pytrace=False)


# --- one fork server per test process for the Megatron jobs -----------------------------------------------
# A session with slow tests (not serial ones) on a machine without CUDA starts lab/megatron_ring_lab/forkrun.py's server: it imports
# torch + Megatron + the glue once, and every forkrun job of this session (tests/helpers/launch.py ``torchrun``, the
# doctor's CPU launcher) forks from it instead of importing them again (about 8 s of CPU per job on 2 cores). A job
# whose environment or sys.path could have imported something else is refused by the server and imports itself.
# Its log (one line per job) is forkrun-server.log in the session's pytest base temp directory.
import shutil  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402

from megatron_ring_lab import forkrun  # noqa: E402

_SERVER: list = []


def pytest_collection_finish(session):
    if (torch.cuda.is_available() or os.environ.get(forkrun.SERVER_VARIABLE) or not hasattr(socket, "send_fds")
            or not any(item.get_closest_marker("slow") and not item.get_closest_marker("serial")
                       for item in session.items)):  # serial tests (wall-clock bounds) get no server importing beside them
        return
    try:
        where = tempfile.mkdtemp(prefix="forkrun-")
        path = os.path.join(where, "socket")
        log = session.config._tmp_path_factory.getbasetemp() / "forkrun-server.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1]),
               forkrun.SERVER_VARIABLE: path}
        with open(log, "w") as out:
            proc = forkrun.start_server(path, out, env, preload=JOB_PRELOAD)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:  # no server: every job imports by itself
        import warnings
        warnings.warn(f"the fork server did not start ({e!r}); each job imports torch and Megatron itself")
        return
    os.environ[forkrun.SERVER_VARIABLE] = path
    _SERVER.extend([proc, where])


def pytest_sessionfinish(session, exitstatus):
    if _SERVER:
        proc, where = _SERVER
        os.environ.pop(forkrun.SERVER_VARIABLE, None)
        proc.kill()
        proc.wait(30)
        shutil.rmtree(where, ignore_errors=True)
        _SERVER.clear()
