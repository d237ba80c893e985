"""A torchrun stand-in for single-node CPU jobs (the suite's, the doctor's), without the per-rank start-up cost:

    python lab/megatron_ring_lab/forkrun.py NPROC PRELOAD SCRIPT [ARGS...]
    python lab/megatron_ring_lab/forkrun.py NPROC PRELOAD -m MODULE [ARGS...]
    python lab/megatron_ring_lab/forkrun.py --exec PRELOAD SCRIPT [ARGS...]     (or -m MODULE [ARGS...])

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

With FORKRUN_SERVER naming the socket of a server (``python forkrun.py --serve SOCKET [PRELOAD]``; the test suite
starts one per pytest process, tests/conftest.py), the job is not imported here at all: this process hands its
command line, environment, directory, sys.path and standard streams to the server, which imported PRELOAD once
for the whole session and forks the job from there, and exits with the job's exit code (see "the server" below;
where the server would not give the job a fresh process's imports it refuses, and the job runs here as above).

``--exec`` runs SCRIPT (or MODULE) in ONE process with the caller's environment as it is (no variable set): a
``python SCRIPT ARGS`` whose imports come from the server. It is for a launcher that starts every process itself
(torchrun's agent: ``torchrun ... forkrun.py --exec PRELOAD SCRIPT ARGS``), so the job must look like that process
from outside: this process forwards the signals it gets (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the
job, and a job killed by a signal ends this process by the same signal (the launcher reads "exitcode -9"). The job
also runs in this process's network namespace (a server elsewhere enters it, or refuses).
"""
from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import signal
import sys
import time
from collections.abc import MutableMapping

GRACE_S = 30.0  # torchrun's SIGTERM -> SIGKILL grace
EXEC = "--exec"  # in place of NPROC: one process, the caller's environment as it is (the module doc)
#: the signals an ``--exec`` client passes on to its job (SIGKILL and SIGSTOP cannot be caught: a killed client takes
#: its job along, below)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: this package's Megatron glue, which ``megatron_ring.megatron`` imports at first use only (its ``MODULES``; a test
#: checks that this list covers them)
GLUE = ("megatron_ring.megatron.arguments,megatron_ring.megatron.attention.module,"
        "megatron_ring.megatron.data.batch,megatron_ring.megatron.config,"
        "megatron_ring.megatron.data.hybrid_cp,megatron_ring.megatron.spec.layers,"
        "megatron_ring.megatron.spec.megatron_lm,megatron_ring.megatron.data.loss,"
        "megatron_ring.megatron.groups.provider,megatron_ring.megatron.data.rope,"
        "megatron_ring.megatron.data.mtp_loss,megatron_ring.megatron.data.token_order,"
        "megatron_ring.megatron.spec")
#: what a Megatron job imports before its ranks fork (a module that is not installed is skipped)
PRELOAD = ("torch,torch.distributed,megatron.core,megatron.training,megatron.training.training,"
           "megatron.core.models.gpt,megatron.core.models.gpt.gpt_layer_specs,megatron.core.models.mamba,"
           + GLUE)
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
    _run_main(script, args)


def _run_main(script: str, args: list[str]) -> None:
    """The script (``-m``: the module, ``args[0]``) as __main__ with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT
    ARGS`` sets them; then the interpreter's normal shutdown with its exit code (never returns)."""
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
    if argv[:1] == ["--serve"] and len(argv) in (2, 3):
        return serve(argv[1], argv[2] if len(argv) == 3 else PRELOAD)
    if len(argv) < 3 or (argv[2] == "-m" and len(argv) < 4) or not (argv[0] == EXEC or argv[0].isdigit()):
        print(__doc__, file=sys.stderr)
        return 2
    server = os.environ.get(SERVER_VARIABLE)
    if server:
        code = _client(server, argv)
        if code is not None:
            if argv[0] == EXEC and code < 0:  # killed by a signal: so is this process, as the job's caller expects
                try:
                    signal.signal(-code, signal.SIG_DFL)  # (Python's own: SIGINT, SIGPIPE; SIGKILL has none)
                except (OSError, ValueError):
                    pass
                os.kill(os.getpid(), -code)
                return 128 - code
            return code
    _import(argv[1])
    if argv[0] == EXEC:
        _run_main(argv[2], argv[3:])
    return _job(int(argv[0]), argv[2], argv[3:])


def _import(preload: str) -> None:
    for name in filter(None, preload.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _job(nproc: int, script: str, args: list[str]) -> int:
    """Fork the ``nproc`` ranks, wait for them; 0, or 1 once a rank failed (the others stopped)."""
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


# --- the server: one process imports PRELOAD once per test session; each job forks from it -----------------
# A job's process (the client: ``python forkrun.py NPROC PRELOAD SCRIPT ...`` with FORKRUN_SERVER set) sends its argv,
# environment, working directory, sys.path and its stdin/stdout/stderr (SCM_RIGHTS) to the server, which forks a
# supervisor; the supervisor forks the job's leader with the client's environment, directory, path and file
# descriptors, and the leader forks the ranks (``_job``; ``--exec``: the leader is the job). The client exits with the
# job's exit code; a client that dies (its caller's time-out, a kill) takes the job with it: its supervisor sees the
# connection close and kills the job's process group. The server refuses, and the client imports PRELOAD itself as
# before, where a fresh process could have imported something else: another Python, a variable that differs and that
# the imports read (seen at the Python level while the server imported; an import that walks the whole environment is
# taken to look for none of the job's own variables) or that C code reads when a process starts (_AT_START:
# ATEN_CPU_CAPABILITY, OMP_NUM_THREADS, ...), or a module the server holds that the job's sys.path would find
# elsewhere. A client in another network namespace (``ip netns exec``) gets its job in that namespace: the job's
# supervisor enters it (``setns``, which needs CAP_SYS_ADMIN), or the server refuses.
SERVER_VARIABLE = "FORKRUN_SERVER"  # the server's socket; unset, or no server there: the job imports PRELOAD itself
#: variables that programs read when a process starts, in C (the loader, glibc, OpenMP, MKL, ATen, CUDA, NCCL, the
#: interpreter itself): a job whose value differs from the server's is refused (PYTHONPATH: its sys.path is checked)
_AT_START = ("LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "ATEN_",
             "TORCH", "PYTORCH_", "CUDA", "NCCL_", "GLOO_", "NVIDIA_", "TRITON_", "PYTHON", "LC_", "LANG", "TZ")
#: variables under those prefixes that torchrun's agent sets for each worker, and that only run-time code reads (torch's
#: elastic Python, read after the imports; ProcessGroupNCCL, when a group is made): a job may differ in them (a read
#: at import is still seen)
_PER_WORKER = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
_HEADER = 8  # the request's length, sent with the client's three standard streams and its network namespace
_CLONE_NEWNET = 0x40000000


def _client(path: str, argv: list[str]) -> int | None:
    """The job run by the server at ``path``: its exit code (negative: the signal that killed it); None where there is
    no server or it refused."""
    import json
    import socket
    import struct
    forward = argv[0] == EXEC
    if forward:  # held until the job's pid is known, then passed on (below)
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [0, 1, 2]
    try:
        fds.append(os.open("/proc/self/ns/net", os.O_RDONLY))
    except OSError:  # no network namespaces here: the server's is the only one
        pass
    try:
        sock.connect(path)
        request = json.dumps({"executable": sys.executable, "argv": argv, "env": dict(os.environ),
                              "cwd": os.getcwd(), "path": sys.path}).encode()
        socket.send_fds(sock, [struct.pack("!Q", len(request))], fds)
        sock.sendall(request)
        answer = _recv(sock, 5)
    except OSError:
        answer = b""
    finally:
        for fd in fds[3:]:
            os.close(fd)
    if answer[:1] != b"Y":  # refused (the reason is in the server's log): this process imports PRELOAD itself
        sock.close()
        if forward:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return None
    if forward:
        job = struct.unpack("!i", answer[1:5])[0]
        for sig in FORWARDED:
            signal.signal(sig, lambda signum, frame: _signal(job, signum))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    code = _recv(sock, 4)
    if len(code) < 4:
        print("[forkrun] the server's job ended without an exit code", file=sys.stderr, flush=True)
        return 1
    return struct.unpack("!i", code)[0]


def _recv(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class _Recording(MutableMapping):
    """``os.environ`` while the server imports: which variables the imports read and set, at the Python level. A
    walk over the environment reads no variable (networkx looks for NETWORKX_BACKEND_PRIORITY_* that way)."""

    def __init__(self, real):
        self.real, self.reads, self.writes = real, set(), {}

    def __getitem__(self, key):
        self.reads.add(key)
        return self.real[key]

    def __setitem__(self, key, value):
        self.writes[key] = value
        self.real[key] = value

    def __delitem__(self, key):
        self.writes[key] = None
        del self.real[key]

    def __iter__(self):
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def keys(self):
        return self.real.keys()

    def items(self):
        return self.real.items()

    def values(self):
        return self.real.values()

    def copy(self):
        return self.real.copy()


def _where(name: str):
    """Where a fresh process with this sys.path would import the top-level module ``name`` from."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, None) if find else None
        if spec is not None:
            return spec.origin or tuple(spec.submodule_search_locations or ())
    return None


def _enter_netns(fd: int | None) -> str | None:
    """Into the network namespace ``fd`` (the client's) when it is not this process's: None, or why not."""
    if fd is None:
        return None
    own, theirs = os.stat("/proc/self/ns/net"), os.fstat(fd)
    if (own.st_dev, own.st_ino) == (theirs.st_dev, theirs.st_ino):
        return None
    try:
        if hasattr(os, "setns"):  # Python 3.12
            os.setns(fd, _CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        return f"the client is in another network namespace, which this server cannot enter ({e})"
    return None


def start_server(path: str, log, env: dict, preload: str = PRELOAD):
    """``python forkrun.py --serve path preload`` in the background (its own session, stdin closed, ``log`` its
    stdout and stderr, ``env`` its environment): the ``subprocess.Popen``. Listening once ``path`` exists."""
    import subprocess
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path, preload], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def serve(path: str, preload: str = PRELOAD) -> int:
    """Listen at ``path`` (a Unix socket), import ``preload`` once, then run each client's job (until killed; it dies
    with its parent). Decisions are logged to stderr, one line per job."""
    import json
    import select
    import socket
    import struct
    _die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # before the imports: a client that comes early waits in the backlog
    listener.listen(64)
    env0, path0 = dict(os.environ), list(sys.path)
    recording = os.environ = _Recording(os.environ)
    try:
        _import(preload)
    finally:
        os.environ = recording.real
    added = [entry for entry in sys.path if entry not in path0]  # by the imports (setuptools' vendored packages)
    own = {"__main__", "forkrun", "megatron_ring_lab"}
    tops = {name: _where(name) for name, mod in list(sys.modules.items())
            if "." not in name and name not in sys.stdlib_module_names and name not in own
            and getattr(mod, "__spec__", None) is not None and (mod.__spec__.origin or mod.__spec__.submodule_search_locations)}
    print(f"[forkrun server] pid {os.getpid()}: imported {preload}; {len(tops)} top-level modules, "
          f"{len(recording.reads)} variables read, {len(recording.writes)} set", file=sys.stderr, flush=True)

    def job_path(request) -> list[str]:  # the job's sys.path, with what the imports added (as a fresh process's)
        return request["path"] + [entry for entry in added if entry not in request["path"]]

    def refusal(request) -> str | None:
        if request["executable"] != sys.executable:
            return f"another Python ({request['executable']})"
        env = request["env"]
        for key in sorted(set(env) | set(env0)):
            if env.get(key) == env0.get(key) or key in recording.writes:
                continue
            if key in recording.reads:
                return f"{key} differs and was read at import"
            if key.startswith(_AT_START) and key != "PYTHONPATH" and not key.startswith(_PER_WORKER):
                return f"{key} differs"
        sys.path[:] = job_path(request)
        for name, origin in tops.items():
            if _where(name) != origin:
                return f"the job's sys.path finds {name} elsewhere"
        return None

    def supervise(conn) -> None:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER, 4)
        netns = fds[3] if len(fds) > 3 else None
        fds = fds[:3]
        request = json.loads(_recv(conn, struct.unpack("!Q", header)[0]))
        why = refusal(request) or _enter_netns(netns)  # this supervisor's own namespace: the server stays in its own
        if netns is not None:
            os.close(netns)
        mode, job_preload, script, *args = request["argv"]
        nproc = 1 if mode == EXEC else int(mode)
        print(f"[forkrun server] {'refused: ' + why if why else 'runs'}: "
              f"{'exec' if mode == EXEC else nproc} x {' '.join([script, *args])[:160]}", file=sys.stderr, flush=True)
        if why:
            conn.sendall(b"N")
            return
        pid = os.fork()
        if pid == 0:  # the job's leader
            conn.close()
            os.setpgid(0, 0)
            _die_with_parent()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
            for fd in fds:
                os.close(fd)
            os.chdir(request["cwd"])
            env = {**request["env"], **{k: v for k, v in recording.writes.items() if v is not None}}
            for key in [k for k, v in recording.writes.items() if v is None]:
                env.pop(key, None)
            os.environ.clear()
            os.environ.update(env)
            sys.path[:] = job_path(request)
            import random
            random.seed()  # a fresh process's own draws, not the server's
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed()
            leader, code = os.getpid(), 1
            try:
                _import(job_preload)
                if mode == EXEC:  # the leader is the job: it ends as a rank does, through the interpreter's shutdown
                    leader = None
                    _run_main(script, args)
                code = _job(nproc, script, args)
            finally:
                if os.getpid() == leader:  # a rank's SystemExit passes on, up to the interpreter's shutdown
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
        try:
            os.setpgid(pid, pid)  # as the leader does itself: whichever runs first, a kill reaches the group
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        conn.sendall(b"Y" + struct.pack("!i", pid))
        watch = [conn]
        try:
            watch.append(os.pidfd_open(pid))
        except (AttributeError, OSError):
            pass
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:  # the client is gone (killed with its job: a lost host)
                    pass
                return
            ready, _, _ = select.select(watch, [], [], 0.05 if len(watch) == 1 else None)
            if conn in ready and not conn.recv(1):  # the client is gone: the job goes too
                _signal(-pid, signal.SIGKILL)
                _signal(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return

    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        while True:  # reap the supervisors that ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not ready:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            supervisor, code = os.getpid(), 0
            try:
                supervise(conn)
            except BaseException:  # noqa: BLE001  (the client gets no answer and imports PRELOAD itself)
                if os.getpid() != supervisor:
                    raise  # a rank's SystemExit (or error): its interpreter's shutdown, as a fresh process's
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                if os.getpid() == supervisor:
                    sys.stderr.flush()
                    os._exit(code)
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
