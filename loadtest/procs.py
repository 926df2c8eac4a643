"""Child processes of the harness: free ports, readiness waits, and stopping that always reaps.

Contract: every process started here dies with the harness (``PR_SET_PDEATHSIG``, so even a
SIGKILLed harness leaves nothing behind) and is stopped by its owner in a ``finally``:
SIGTERM to its process group, a bounded wait, then SIGKILL. Spawn only from the main thread:
the death signal follows the *thread* that forked.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port from that range (what
    binding port 0 gives) can be taken as the source port of any outgoing connection before
    the server that was handed it binds (a CI run lost a gateway to EADDRINUSE that way)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], *, log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own session (Ctrl-C reaches the harness only, which stops it in
    order), output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)


def log_tail(path: Path, n_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "(no log)"


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Until GET ``url`` answers 200; raises with the log tail if ``proc`` dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(proc.args[0]).name} exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s:\n{log_tail(log_path)}")


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s} s")


def stop_group(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the child's process group (it leads one: ``spawn`` starts a session), wait,
    then SIGKILL the group. Idempotent."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)  # grandchildren that outlived their parent
    if proc.poll() is None:
        proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_hard(pid: int) -> None:
    """SIGKILL ``pid`` and the process group it leads, if any."""
    _signal_group(pid, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (one /proc scan)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return parent


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return [child for child, parent in _parents().items() if parent == pid]


def tree(roots: list[int]) -> list[int]:
    """``roots`` and every process below them (one /proc scan)."""
    parent = _parents()
    out, todo = [], [r for r in roots if r in parent]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, pp in parent.items() if pp == pid]
    return out


def pause_trees(roots: list[int], sig: int = signal.SIGSTOP) -> int:
    """SIGSTOP (or, with ``sig=SIGCONT``, resume) ``roots`` and their descendants: a benchmark
    target not being measured must not spend the shared cores on its idle polling. Returns how
    many processes were signalled."""
    n = 0
    for pid in tree(roots):
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def argv_of(pid: int) -> list[str]:
    """``pid``'s command line; [] if it is gone. A process the zygote forked shows the command
    line it stands for as one title (shared/process/zygote_main.py): split on its spaces."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    argv = raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return argv[0].split(" ") if len(argv) == 1 else argv


def worker_count(supervisor_pid: int) -> int:
    """Worker processes (``mmfleet worker --stages ...``) among a supervisor's children."""
    return sum("--stages" in argv_of(pid) for pid in children_of(supervisor_pid))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def broker(log_dir: Path, pids: list[int] | None = None):
    """The embedded tansu broker on a free port; yields its bootstrap address (its pid is
    appended to ``pids``, when given)."""
    from services import embedded_broker

    port = free_port()
    argv, env = embedded_broker.command(f"tcp://127.0.0.1:{port}")
    proc = spawn(argv, log_path=log_dir / "tansu.log", env=env)
    if pids is not None:
        pids.append(proc.pid)
    try:
        wait_port(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(proc)


@contextmanager
def redis_server(log_dir: Path, *, password: str | None = None, pids: list[int] | None = None,
                 port: int | None = None):
    """A throwaway ``redis-server`` on a free port, or ``port`` (no persistence); yields its URL.
    With ``password``, clients must authenticate (``--requirepass``; the URL does not carry it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH (needed by fleet targets)")
    port = port or free_port()
    auth = ["--requirepass", password] if password else []
    proc = spawn([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", *auth],
                 log_path=log_dir / "redis.log")
    if pids is not None:
        pids.append(proc.pid)
    try:
        wait_port(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_group(proc)


def model_dir(explicit: Path | None) -> Path:
    """``explicit``, or the model the settings in force name (the demo model by default)."""
    if explicit:
        return explicit
    from shared import settings as settings_mod
    from shared.models.registry import resolve_model_path

    return resolve_model_path(settings_mod.from_env())

