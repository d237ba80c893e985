"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair (needs root + iproute2).

    with TwoHosts() as hosts:          # creates mrmn<pid>a / mrmn<pid>b, 10.77.0.1/24 <-> 10.77.0.2/24
        a, b = hosts
        subprocess.run(a.exec_prefix() + ["ping", "-c1", b.addr])

Each namespace has its own network stack: ``lo`` (up) and one end of the veth pair, created directly
inside the namespace (no interface ever appears in the root namespace), so the addresses are private
to these two namespaces and cannot collide with anything else on the machine, nor with a concurrent run
(namespace names carry the creating process id). Teardown (also on exceptions) SIGKILLs every process
still inside the namespaces and deletes them; namespaces with our prefix whose creating process is gone
(a previous crashed run) are removed on the next :class:`TwoHosts` entry.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "mrmn"  # megatron_ring multi-node; full name: mrmn<pid>x<instance><a|b>
SUBNET = "10.77.0"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)(x\d+)?([a-z])$")
_instances = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no CAP_SYS_ADMIN...)."""


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=check)


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its veth interface and its address."""

    ns: str
    ifname: str
    addr: str
    index: int

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def pids(self) -> list[int]:
        """Processes whose network namespace is this one."""
        r = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in the namespace; returns the pids signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, up: bool) -> None:
        """Bring this host's veth end up or down (down = the host drops off the network, no FIN/RST)."""
        _ip("-n", self.ns, "link", "set", "dev", self.ifname, "up" if up else "down")


def unavailable_reason() -> str | None:
    """None if namespaces can be made, else why not (for ``pytest.skip``)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); CI runs as root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"{PREFIX}{os.getpid()}p"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"'ip netns add' failed: {r.stderr.strip() or r.returncode}"
        r = _ip("-n", probe, "link", "add", "mrprobe0", "type", "veth", "peer", "name", "mrprobe1", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip() or r.returncode}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_ns(ns: str) -> None:
    r = _ip("netns", "pids", ns, check=False)
    for p in r.stdout.split():
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for _ in range(50):  # processes must be gone before the namespace can really go away
        if not _ip("netns", "pids", ns, check=False).stdout.split():
            break
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def list_ours() -> list[str]:
    r = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def remove_stale() -> list[str]:
    """Delete our namespaces left behind by a process that no longer exists; returns their names."""
    removed = []
    for ns in list_ours():
        pid = int(_NAME_RE.match(ns).group(1))
        if pid != os.getpid() and not _alive(pid):
            _delete_ns(ns)
            removed.append(ns)
    return removed


class TwoHosts:
    """Context manager: ``n`` (default 2) namespaces on one veth pair / bridge-free link, addresses
    ``10.77.0.1`` .. ``10.77.0.n`` (/24). Only n == 2 is supported (one veth pair)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        pid = os.getpid()
        n = next(_instances)  # several TwoHosts may coexist in one process
        self.hosts = [Host(ns=f"{PREFIX}{pid}x{n}{c}", ifname=f"mrveth{i}", addr=f"{SUBNET}.{i + 1}", index=i)
                      for i, c in enumerate("ab")]

    def __enter__(self) -> list[Host]:
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self.hosts

    def _create(self) -> None:
        a, b = self.hosts
        for h in self.hosts:
            if h.ns in list_ours():  # left over by an earlier process with our pid
                _delete_ns(h.ns)
            _ip("netns", "add", h.ns)
        _ip("-n", a.ns, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        for h in self.hosts:
            _ip("-n", h.ns, "link", "set", "dev", "lo", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", "dev", h.ifname, "up")
        # wait for the carrier on both ends so the first connection does not race the link
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = [_ip("-n", h.ns, "-br", "link", "show", "dev", h.ifname, check=False).stdout.split()
                      for h in self.hosts]
            if all(len(st) > 1 and st[1] == "UP" for st in states):
                return
            time.sleep(0.1)
        raise NetnsUnavailable(f"veth link between {a.ns} and {b.ns} did not come up: {states}")

    def close(self) -> None:
        for h in self.hosts:
            _delete_ns(h.ns)

    def __exit__(self, *exc) -> None:
        self.close()
