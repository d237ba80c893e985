"""lab/megatron_ring_lab/forkrun.py: a job run by its server is the job a fresh process runs (output, exit code,
environment, directory, ranks); the server refuses a job whose imports could differ, and that job runs by itself;
a client that is killed takes its job along. ``--exec`` (one process, as torchrun's agent starts a worker): the
caller's environment as it is, signals passed on, a death by signal passed back, the caller's network namespace."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from megatron_ring_lab import forkrun

pytestmark = pytest.mark.slow

JOB = """
import os, sys
import probe_module
rank = int(os.environ["RANK"])
# one write per line: the ranks share the streams (unbuffered, print writes the newline apart)
os.write(1, (f"rank {rank} of {os.environ['WORLD_SIZE']} argv {sys.argv[1:]} cwd {os.getcwd()} "
             f"tag {os.environ.get('MEGATRON_RING_TAG')} probe {probe_module.SEEN} "
             f"loaded {'probe_module' in sys.modules}\\n").encode())
os.write(2, f"rank {rank} to stderr\\n".encode())
if os.environ.get("SLEEP"):
    open(os.path.join(os.environ["SLEEP"], f"pid{rank}"), "w").write(str(os.getpid()))
    import time
    time.sleep(600)
sys.exit(int(os.environ.get("FAIL_RANK", "-1")) == rank and 3 or 0)
"""
# one process, as torchrun's agent starts a worker (``--exec``): what it was given, where it runs, then an exit as asked
EXEC_JOB = """
import os, signal, sys, time
import probe_module
def record(line):
    with open(os.path.join(os.environ["OUT"], "record"), "a") as f:
        f.write(line + "\\n")
record(f"rank {os.environ.get('RANK')} world {os.environ.get('WORLD_SIZE')} "
       f"run {os.environ.get('TORCHELASTIC_RUN_ID')} argv {sys.argv[1:]} cwd {os.getcwd()} probe {probe_module.SEEN} "
       f"netns {os.stat('/proc/self/ns/net').st_ino}")
mode = os.environ.get("MODE", "")
if mode == "term":  # as tests/multinode/mn_driver.py: a SIGTERM is recorded, then a hard exit
    signal.signal(signal.SIGTERM, lambda *a: (record("sigterm"), os._exit(128 + signal.SIGTERM)))
    record("waiting")
    time.sleep(600)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(os.environ.get("EXIT", "0")))
"""
# imported by the server (PRELOAD): it reads one per-job variable at import, which a job must then not change
PROBE = 'import os\nSEEN = os.environ.get("MEGATRON_RING_PROBE")\n'


@pytest.fixture
def server(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_module.py").write_text(PROBE)
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "exec_job.py").write_text(EXEC_JOB)
    (tmp_path / "work").mkdir()
    path = str(tmp_path / "socket")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "mods"), "OMP_NUM_THREADS": "1",
           forkrun.SERVER_VARIABLE: path, "MEGATRON_RING_PROBE": "at import"}
    log = open(tmp_path / "server.log", "w")
    proc = forkrun.start_server(path, log, env, preload="probe_module")
    deadline = time.monotonic() + 60  # listening (its socket bound): a client that came earlier would run alone
    while not os.path.exists(path):
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    try:
        yield tmp_path, env
    finally:
        proc.kill()
        proc.wait(30)
        log.close()


def _run(tmp_path, env, *extra, **changes):
    e = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **changes}
    return subprocess.run([*forkrun.command(2, tmp_path / "job.py", "a", "b", preload="probe_module"), *extra],
                          env={k: v for k, v in e.items() if v is not None}, cwd=tmp_path / "work",
                          capture_output=True, text=True, timeout=120)


def _decisions(tmp_path) -> list[str]:
    return [line.split(":")[0] for line in (tmp_path / "server.log").read_text().splitlines()
            if line.startswith("[forkrun server] r")]


def _sorted(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("rank"))


def test_a_served_job_is_the_job_a_fresh_process_runs(server):
    tmp_path, env = server
    served = _run(tmp_path, env, MEGATRON_RING_TAG="served")
    alone = _run(tmp_path, env, MEGATRON_RING_TAG="served", **{forkrun.SERVER_VARIABLE: None})
    assert served.returncode == alone.returncode == 0, (served.stderr, alone.stderr)
    assert _sorted(served.stdout) == _sorted(alone.stdout) == sorted(
        f"rank {r} of 2 argv ['a', 'b'] cwd {tmp_path / 'work'} tag served probe at import loaded True"
        for r in range(2))
    assert _sorted(served.stderr) == _sorted(alone.stderr) == ["rank 0 to stderr", "rank 1 to stderr"]
    failed = _run(tmp_path, env, FAIL_RANK="1")
    assert failed.returncode == 1 and "rank 1 exited with 3" in failed.stderr, failed.stderr
    assert _decisions(tmp_path) == ["[forkrun server] runs", "[forkrun server] runs"]  # the control ran alone


def test_a_job_whose_imports_could_differ_runs_by_itself(server):
    """Refused: a per-job variable the server's imports read (``MEGATRON_RING_PROBE``), and a variable that is not
    per-job (C code may read it at start-up). Each job then imports PRELOAD itself and sees its own values."""
    tmp_path, env = server
    probe = _run(tmp_path, env, MEGATRON_RING_PROBE="the job's")
    other = _run(tmp_path, env, ATEN_CPU_CAPABILITY="default")
    assert probe.returncode == other.returncode == 0, (probe.stderr, other.stderr)
    assert all("probe the job's" in line for line in _sorted(probe.stdout)), probe.stdout
    assert all("probe at import" in line for line in _sorted(other.stdout)), other.stdout
    log = (tmp_path / "server.log").read_text()
    assert "refused: MEGATRON_RING_PROBE differs and was read at import" in log, log
    assert "refused: ATEN_CPU_CAPABILITY differs" in log, log
    assert "runs" not in "".join(_decisions(tmp_path))


def test_a_killed_client_takes_its_job_along(server):
    tmp_path, env = server
    e = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "SLEEP": str(tmp_path)}
    client = subprocess.Popen(forkrun.command(2, tmp_path / "job.py", preload="probe_module"), env=e,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and client.poll() is None, "the job's ranks did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in files]
    client.send_signal(signal.SIGKILL)
    client.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their killed client"
        time.sleep(0.1)
    assert _decisions(tmp_path) == ["[forkrun server] runs"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by its dead parent's reaper) is gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # it went (and was reaped) between the two looks
        return False


def _exec(tmp_path, env, prefix=(), **changes):
    """``--exec`` of exec_job.py as torchrun's agent starts a worker (its variables set); ``prefix``: a command to run
    the client under (``ip netns exec NS``)."""
    (tmp_path / "record").unlink(missing_ok=True)
    e = {**env, "OUT": str(tmp_path), "RANK": "5", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run-7", **changes}
    cmd = forkrun.command(forkrun.EXEC, tmp_path / "exec_job.py", "a", preload="probe_module")
    return subprocess.Popen([*prefix, *cmd], env={k: v for k, v in e.items() if v is not None}, cwd=tmp_path / "work",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record(tmp_path) -> list[str]:
    path = tmp_path / "record"
    return path.read_text().splitlines() if path.exists() else []


def test_an_exec_job_is_the_process_a_fresh_python_runs(server):
    """The worker's variables stay as given (no rank variables set; torchrun's TORCHELASTIC_* may differ from the
    server's), argv, directory and exit code are a fresh process's; the control runs without a server."""
    tmp_path, env = server
    netns = os.stat("/proc/self/ns/net").st_ino
    want = (f"rank 5 world 8 run run-7 argv ['a'] cwd {tmp_path / 'work'} probe at import netns {netns}")
    for served in (True, False):
        job = _exec(tmp_path, env, EXIT="4", **({} if served else {forkrun.SERVER_VARIABLE: None}))
        assert job.wait(120) == 4, job.stderr.read()
        assert _record(tmp_path) == [want]
    assert _decisions(tmp_path) == ["[forkrun server] runs"]


def test_an_exec_client_passes_signals_on_and_dies_as_its_job(server):
    """A SIGTERM to the client reaches the job (its handler records it; the client exits with the job's code); a job
    that SIGKILLs itself ends its client by SIGKILL (torchrun's agent reports "exitcode -9" for the worker)."""
    tmp_path, env = server
    job = _exec(tmp_path, env, MODE="term")
    deadline = time.monotonic() + 60
    while "waiting" not in _record(tmp_path):
        assert time.monotonic() < deadline and job.poll() is None, job.stderr.read() if job.poll() else "no start"
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM, job.stderr.read()
    assert _record(tmp_path)[1:] == ["waiting", "sigterm"]
    killed = _exec(tmp_path, env, MODE="kill")
    assert killed.wait(60) == -signal.SIGKILL, killed.stderr.read()
    assert _decisions(tmp_path) == ["[forkrun server] runs", "[forkrun server] runs"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2")
def test_an_exec_job_runs_in_its_clients_network_namespace(server):
    """A client in another network namespace (``ip netns exec``, as tests/multinode runs torchrun): its job runs in
    that namespace, not in the server's (the negative control: the two differ)."""
    tmp_path, env = server
    ns = f"mrfk{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:  # root without CAP_SYS_ADMIN (a container)
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        theirs = int(subprocess.run(["ip", "netns", "exec", ns, "stat", "-L", "-c", "%i", "/proc/self/ns/net"],
                                    check=True, capture_output=True, text=True).stdout)
        job = _exec(tmp_path, env, prefix=("ip", "netns", "exec", ns))
        assert job.wait(120) == 0, job.stderr.read()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert theirs != os.stat("/proc/self/ns/net").st_ino
    assert _record(tmp_path)[0].endswith(f"netns {theirs}")
    assert _decisions(tmp_path) == ["[forkrun server] runs"]
