"""Fleet processes forked from one process that has imported torch and transformers once (the
zygote, :mod:`shared.process.zygote_main`), so a worker or gateway starts without paying ~6 s of imports
again. The parent (``mmfleet up``) makes itself a child subreaper, starts the zygote
(:meth:`Zygote.start`) and asks it for ``python -m MODULE ...`` command lines
(:meth:`Zygote.spawn`). The zygote forks twice, so the new process is the parent's own child
exactly as if ``subprocess.Popen`` had started it (:class:`Adopted` is its handle). A zygote that
did not start, or has gone, raises :class:`ZygoteGone` and the caller starts the command itself.

Design: docs/design/startup.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<I")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
preloaded = False  # true in a process the zygote forked (shared.process.zygote_main sets it)
READY_TIMEOUT_S = 180.0  # its imports; a loaded 2-core machine has taken ~15 s
SPAWN_TIMEOUT_S = 30.0


# The zygote's private protocol (supervisor ↔ zygote over a socket pair; not on the fleet's wire,
# see shared.protocol): Spawn → Spawned | Failed, after the zygote's Ready.
class Spawn(msgspec.Struct, tag=True):
    """Start ``python -m module *args`` with ``env``, stdout and stderr appended to ``log_path``
    (else the zygote's), in its own session unless ``new_session`` is false, with the file
    descriptors sent beside this message (SCM_RIGHTS) as ``fd_targets``."""

    module: str
    args: list[str]
    env: dict[str, str]
    log_path: str | None
    title: str  # what /proc/PID/cmdline shows: the command line it stands for
    new_session: bool = True
    fd_targets: list[int] = []  # the numbers the passed descriptors get (those its args name)


class Ready(msgspec.Struct, tag=True):
    """The zygote has imported what it preloads (``threads``: its own count; it forks only at 1)."""

    pid: int
    threads: int


class Spawned(msgspec.Struct, tag=True):
    pid: int


class Failed(msgspec.Struct, tag=True):
    why: str


FromZygote = Ready | Spawned | Failed
_ENC = msgspec.msgpack.Encoder()
_DEC_FROM = msgspec.msgpack.Decoder(FromZygote)
_DEC_TO = msgspec.msgpack.Decoder(Spawn)


class ZygoteGone(Exception):
    """The zygote cannot spawn (not started, not fork-safe, or exited): start the command
    without it."""


def send(sock: socket.socket, msg: msgspec.Struct, fds: tuple[int, ...] = ()) -> None:
    body = _ENC.encode(msg)
    data = _HEAD.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, decoder=_DEC_FROM):
    """The next message, or None at EOF."""
    head = _recv_exact(sock, _HEAD.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEAD.unpack(head)[0])
    return None if body is None else decoder.decode(body)


def recv_spawn(sock: socket.socket) -> tuple[Spawn, list[int]] | None:
    """The next request and the descriptors sent with it (they arrive with its first bytes)."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEAD.size, 16)
    if not head:
        return None
    rest = _recv_exact(sock, _HEAD.size - len(head))
    body = None if rest is None else _recv_exact(sock, _HEAD.unpack(head + rest)[0])
    if body is None:
        return None
    return _DEC_TO.decode(body), fds


def become_subreaper() -> None:
    """Orphaned descendants (the zygote's grandchildren) are reparented to this process, not
    to init; it must reap the strays among them (:func:`reap_strays`)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def reap_strays(known: set[int]) -> list[int]:
    """Reaps exited children of this process that no handle owns (a subreaper inherits a dead
    worker's own children: its vLLM engine core, its decode core); returns their pids."""
    reaped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in known:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            try:
                if os.waitpid(int(entry.name), os.WNOHANG)[0]:
                    reaped.append(int(entry.name))
            except ChildProcessError:
                pass
    return reaped


class Adopted:
    """``subprocess.Popen``'s handle (the part a supervisor uses) for a child the zygote forked
    and this process adopted."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one waitpid at a time: a second would find no child

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:  # the way Popen.wait(timeout) waits too
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reused pid
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The parent's side: one zygote process, asked over a socket pair."""

    def __init__(self, proc: subprocess.Popen | Adopted, sock: socket.socket, ready: Ready | None = None) -> None:
        self.proc = proc
        self._sock = sock
        self._lock = threading.Lock()
        self._ready = ready
        self._gone: str | None = None

    @classmethod
    def start(cls, env: dict[str, str], log_path: Path | None, *, model_dir: str,
              preload: tuple[str, ...] = ()) -> Zygote:
        """Starts ``python -m shared.process.zygote_main``, which imports torch, transformers and
        ``preload`` (module names; ``module:function`` also calls ``function(model_dir)``); it runs
        under ``env``, the environment its children get (less their own differences: a worker's
        metrics port)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - closed below
        try:
            argv = [sys.executable, "-m", "shared.process.zygote_main", "--fd", str(theirs.fileno()), "--model-dir",
                    model_dir, "--preload", ",".join(preload)]
            proc = subprocess.Popen(argv, env=env, pass_fds=(theirs.fileno(),), stdout=out,
                                    stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                    preexec_fn=die_with_parent)
        finally:
            theirs.close()
            if out is not None:
                out.close()
        log.info("started the zygote (pid %d)", proc.pid)
        return cls(proc, mine)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Blocks until the zygote has imported what it preloads; False (and it is stopped)
        if it cannot fork safely or did not come up."""
        with self._lock:
            if self._ready is not None or self._gone is not None:
                return self._ready is not None
            self._sock.settimeout(timeout_s)
            try:
                msg = recv(self._sock)
            except (OSError, msgspec.DecodeError) as exc:
                msg = Failed(f"{type(exc).__name__}: {exc}")
            if isinstance(msg, Ready) and msg.threads == 1:
                self._ready = msg
                return True
            why = (f"it runs {msg.threads} threads after its imports (forking it would not be safe)"
                   if isinstance(msg, Ready) else msg.why if isinstance(msg, Failed) else "it exited")
            self._fail(why)
            return False

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path | None, *, new_session: bool = True,
              pass_fds: tuple[int, ...] = ()) -> Adopted:
        """``argv`` (``[sys.executable, "-m", module, ...]``) forked from the zygote, with
        ``pass_fds`` open in it under the same numbers; raises ZygoteGone where it cannot be
        (the caller execs it instead). The new process is reparented to this one, in a session
        of its own unless ``new_session`` is false, with ``env`` and ``log_path``, dying with its
        parent (``PR_SET_PDEATHSIG``), its ``/proc/PID/cmdline`` set to ``argv``."""
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            raise ZygoteGone(f"not a `python -m` command line: {argv[:3]}")
        if not self.wait_ready():
            raise ZygoteGone(self._gone)
        with self._lock:
            if self._gone is not None:
                raise ZygoteGone(self._gone)
            self._sock.settimeout(SPAWN_TIMEOUT_S)
            try:
                send(self._sock, Spawn(argv[2], argv[3:], env, str(log_path) if log_path else None, " ".join(argv),
                                       new_session, list(pass_fds)), pass_fds)
                msg = recv(self._sock)
            except (OSError, msgspec.DecodeError) as exc:  # the connection is broken: so is the zygote
                msg = f"{type(exc).__name__}: {exc}"
            if isinstance(msg, Spawned):
                return Adopted(msg.pid, argv)
            if isinstance(msg, Failed):  # this fork failed (out of memory, out of pids): the zygote stays
                raise ZygoteGone(msg.why)
            self._fail(msg or "it exited")
            raise ZygoteGone(self._gone)

    def _fail(self, why: str) -> None:
        self._gone = why
        log.warning("the zygote cannot start processes (%s); they start as their own `python -m` from here on", why)
        self.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes its socket (it exits at EOF), then SIGTERM / SIGKILL if it has not."""
        self._gone = self._gone or "stopped"
        self._sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
