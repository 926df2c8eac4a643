"""Hosts for tests: Linux network namespaces on a private bridge, each with its own address.

Contract: :func:`hosts` creates one namespace per host name plus a "switch" namespace that
holds the bridge, so nothing is added to the machine's own namespace (veth pairs are born
there and moved out at once). Addresses are 10.213.0.<i+1>/24 and exist only inside these
namespaces: no traffic can leave them. Names carry the creating pid; every namespace (and with
it every veth and the bridge) and every process started in one is removed on the way out,
failure included, and namespaces left by a creator that died (SIGKILL) are removed the next
time. :func:`unavailable` says why namespaces cannot be made here (the test then skips).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from loadtest import procs

PREFIX = "mmfleet-t"
SUBNET = "10.213.0"
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """None when namespaces can be created here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()} (needs root / CAP_SYS_ADMIN)"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, argv: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen:
        """``argv`` inside this host's namespace (``ip netns exec`` execs it: same pid)."""
        proc = procs.spawn(["ip", "netns", "exec", self.netns, *argv], env=env, cwd=procs.REPO, log_path=log_path)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out]

    def take_down(self) -> None:
        """The host dies: SIGKILL everything in it, then delete its namespace (and its veth)."""
        for pid in self.pids():
            procs.kill_hard(pid)
        for p in self.procs:
            if p.poll() is None:
                p.wait(10)
        _ip("netns", "del", self.netns, check=False)

    def stop(self) -> None:
        for p in reversed(self.procs):
            procs.stop_group(p, timeout_s=20)
        for pid in self.pids():  # anything that escaped its group
            procs.kill_hard(pid)


def _remove_stale() -> None:
    """Namespaces of ours whose creator is gone (a test run that was SIGKILLed)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        creator = name[len(PREFIX):].split("-", 1)[0]
        if creator.isdigit() and not procs.alive(int(creator)):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                procs.kill_hard(int(pid))
            _ip("netns", "del", name, check=False)


@contextmanager
def hosts(names: list[str]) -> Iterator[dict[str, Host]]:
    _remove_stale()
    tag = f"{PREFIX}{os.getpid()}"
    switch = f"{tag}-switch"
    made: dict[str, Host] = {}
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            host = made[name] = Host(name, f"{tag}-{name}", f"{SUBNET}.{i + 1}")
            _ip("netns", "add", host.netns)
            a, b = f"mmv{os.getpid() % 100000}h{i}", f"mmv{os.getpid() % 100000}s{i}"  # <= 15 chars
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", host.netns)
            _ip("link", "set", b, "netns", switch)
            _ip("-n", host.netns, "link", "set", a, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "set", b, "master", "br0", "up")
        yield made
    finally:
        for host in made.values():
            host.stop()
        for ns in [h.netns for h in made.values()] + [switch]:
            _ip("netns", "del", ns, check=False)  # the veths and the bridge go with them


def run_in(host: Host, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a fresh thread that joined ``host``'s network namespace (sockets it
    opens live there); returns its result or raises its exception."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{host.netns}", os.O_RDONLY)
            try:
                if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {host.netns} failed")
            finally:
                os.close(fd)
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    t = threading.Thread(target=target, name=f"in-{host.name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
