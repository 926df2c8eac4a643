"""The zygote's process (``python -m shared.process.zygote_main --fd N --model-dir D --preload ...``,
started by :class:`shared.process.zygote.Zygote`): imports what a fleet process will (:func:`preload`),
says ``Ready`` (with its thread count: it must fork single-threaded), then serves ``Spawn``
requests on its socket until EOF. Each is forked twice so that the new process is reparented to
the zygote's parent, a child subreaper; the forked process then runs its module as ``__main__``,
as ``python -m`` would. :func:`fork_here` forks such a zygote from a running process instead.

Design: docs/design/startup.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import time

from shared.process import zygote

_PID = struct.Struct("<i")
REPARENT_TIMEOUT_S = 5.0


def preload(model_dir: str, modules: list[str]) -> None:
    """What every fleet process imports (~6 s of CPU on this 2-core machine): torch, transformers
    and ``modules``, named by the caller (:meth:`Zygote.start`'s ``preload``: this library does not
    know what runs above it). ``module:function`` also calls ``function(model_dir)``: how the
    transformers engine imports its model's and processor's modules, no weights (~6 s more)."""
    import importlib

    for name in ("torch", "transformers", *modules):
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)(model_dir)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fork_adopted(spawn: zygote.Spawn, parent: int) -> int | zygote.Spawn:
    """In the zygote: the grandchild's pid once its parent (the intermediate) has exited. In the
    grandchild: ``spawn`` itself, to run once the call stack is back at ``main``."""
    r, w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                return spawn
            os.write(w, _PID.pack(pid))
        except BaseException:  # noqa: BLE001 - the intermediate reports by its exit status alone
            os._exit(1)
        os._exit(0)
    os.close(w)
    try:
        data = os.read(r, _PID.size)
    finally:
        os.close(r)
        os.waitpid(intermediate, 0)  # the grandchild is the parent's from here on
    if len(data) != _PID.size:
        raise OSError("the intermediate process did not fork")
    return _PID.unpack(data)[0]


def _title(text: str) -> None:
    """``/proc/PID/cmdline`` shows ``text`` (one string, padded with NULs: read it with
    ``loadtest.procs.argv_of``); the process name (``comm``) stays what it was."""
    import setproctitle

    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    setproctitle.setproctitle(text)
    setproctitle.setthreadtitle(comm)


def _become(spawn: zygote.Spawn, fds: list[int], parent: int) -> None:
    """The grandchild, before its module runs: adopted, in its own session, dying with the
    parent, with the environment, output and command line it was asked for."""
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != parent:  # the intermediate's exit reparents it
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0005)
    zygote.die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)
    if spawn.new_session:
        os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd, target in zip(fds, spawn.fd_targets, strict=True):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    if spawn.log_path is not None:
        fd = os.open(spawn.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _title(spawn.title)  # before the environment changes: setproctitle finds its room by the original one
    os.environ.clear()
    os.environ.update(spawn.env)
    zygote.preloaded = True
    sys.argv = [spawn.module, *spawn.args]
    sys.modules.pop(spawn.module, None)  # preloaded (services.cli): runpy runs it afresh as __main__
    gc.freeze()  # what it inherited stays out of its collections (shared until written)
    gc.enable()  # as in a new interpreter; a fleet process turns it off while it starts (gcpolicy)


def serve(sock: socket.socket, parent: int) -> tuple[zygote.Spawn, list[int]] | None:
    """Forks what is asked until EOF (None); in a forked process, returns what it was asked to
    be, to become it (:func:`_become`) once back at the bottom of the stack."""
    while True:
        got = zygote.recv_spawn(sock)
        if got is None:
            return None
        spawn, fds = got
        try:
            pid = _fork_adopted(spawn, parent)
        except OSError as exc:
            pid = zygote.Failed(f"fork failed: {exc}")
        if isinstance(pid, zygote.Spawn):
            sock.close()
            return spawn, fds
        for fd in fds:  # the forked process holds them now
            os.close(fd)
        zygote.send(sock, zygote.Spawned(pid) if isinstance(pid, int) else pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.process.zygote_main")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--preload", default="", help="comma-separated modules to import before serving")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    parent = os.getppid()
    gc.disable()  # start-up objects are frozen below, as in every fleet process (shared/process/gcpolicy.py)
    try:
        from shared.process.device import keep_triton_out
        from shared.settings import from_env

        keep_triton_out(from_env().device)  # the children's settings; before preload imports torch._dynamo
        preload(args.model_dir, [m for m in args.preload.split(",") if m])
    except Exception as exc:  # noqa: BLE001 - reported; the parent starts processes without us
        zygote.send(sock, zygote.Failed(f"preload: {type(exc).__name__}: {exc}"))
        return 1
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use the GPU
        zygote.send(sock, zygote.Failed("CUDA was initialised by the preload"))
        return 1
    gc.freeze()  # shared with every child until written: no collection of theirs scans it
    threads = _threads()
    zygote.send(sock, zygote.Ready(os.getpid(), threads))
    if threads != 1 or threading.active_count() != 1:
        return 1
    got = serve(sock, parent)
    if got is None:
        return 0
    _become(*got, parent)
    runpy.run_module(got[0].module, run_name="__main__", alter_sys=True)
    return 0


def fork_here() -> zygote.Zygote | None:
    """A zygote forked from this process, which has imported what the processes it will start
    need (a worker the zygote forked: its decode core). Those are adopted by this process (it
    becomes a child subreaper). None where this process runs threads (forking is not safe):
    start them as their own ``python -m``."""
    if _threads() != 1:
        return None
    zygote.become_subreaper()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # never returns: it serves until this process closes its end, then exits
        code = 0
        try:
            mine.close()
            zygote.die_with_parent()
            _title(f"{sys.executable} -m shared.process.zygote_main --forked-by {parent}")
            got = serve(theirs, parent)
            if got is not None:  # a process it forked: run its module here, exit with its code
                _become(*got, parent)
                try:
                    runpy.run_module(got[0].module, run_name="__main__", alter_sys=True)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - never back into the caller's stack
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    theirs.close()
    return zygote.Zygote(zygote.Adopted(pid, ["zygote"]), mine, zygote.Ready(pid, 1))


if __name__ == "__main__":
    sys.exit(main())
