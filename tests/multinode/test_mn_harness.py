"""The namespace harness itself: addresses, isolation, cleanup on failure, stale-namespace removal."""
import subprocess
import sys

import pytest

import netns


@pytest.fixture(autouse=True)
def _need_netns():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")


def _in(host, code):
    return subprocess.run(host.exec_prefix() + [sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_two_hosts_reach_each_other_and_are_cleaned_up_on_error():
    names = []
    with pytest.raises(RuntimeError, match="boom"):
        with netns.TwoHosts() as (a, b):
            names = [a.ns, b.ns]
            assert set(names) <= set(netns.list_ours())
            assert (a.addr, b.addr) == ("10.77.0.1", "10.77.0.2")
            server = subprocess.Popen(b.exec_prefix() + [sys.executable, "-c", (
                "import socket; s = socket.socket(); s.bind(('10.77.0.2', 29999)); s.listen(1); "
                "c, _ = s.accept(); c.sendall(b'pong'); c.close()")], start_new_session=True)
            try:
                r = None
                for _ in range(50):
                    r = _in(a, "import socket; c = socket.create_connection(('10.77.0.2', 29999), timeout=5); "
                               "print(c.recv(4).decode())")
                    if r.returncode == 0:
                        break
                assert r.stdout.strip() == "pong", r.stderr
                server.wait(timeout=30)
            finally:
                if server.poll() is None:
                    server.kill()
            # separate network stacks: host a has no 10.77.0.2 of its own, the root namespace has neither
            assert "10.77.0.2" not in subprocess.run(a.exec_prefix() + ["ip", "-br", "addr"], capture_output=True,
                                                     text=True, timeout=30).stdout
            raise RuntimeError("boom")
    assert names and not set(names) & set(netns.list_ours())


def test_stale_namespaces_of_dead_runs_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    stale = f"{netns.PREFIX}{dead.pid}a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    try:
        assert stale in netns.list_ours()
        with netns.TwoHosts() as (a, b):
            assert stale not in netns.list_ours()
            ours = {a.ns, b.ns}
            assert ours <= set(netns.list_ours())
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=30)
    assert stale not in netns.list_ours()
    assert not ours & set(netns.list_ours())  # our own namespaces were removed by the context manager above
