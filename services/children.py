"""The processes ``mmfleet up`` supervises: :class:`Child` starts one (forked by the zygote
where there is one, else ``Popen``), stops it (SIGTERM, a bound, SIGKILL) and kills what it
left in its process group; the broker and Redis children, and waiting for a port.

Design: docs/design/startup.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from services import embedded_broker
from shared.process.zygote import Adopted, Zygote, ZygoteGone, die_with_parent
from shared.settings import Settings

log = logging.getLogger("mmfleet.up")


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool
    env: dict[str, str] | None = None
    proc: subprocess.Popen | Adopted | None = None
    restarts: int = 0
    started_at: float = 0.0
    restarting: bool = False
    host: str = "127.0.0.1"  # infra: the address it listens on (the bootstrap's / redis_url's host)
    port: int | None = None  # infra: where it must listen again after a restart
    log_path: Path | None = None
    zygote: Zygote | None = None  # forks it (shared/process/zygote.py) where it can; else Popen
    _log_file: object = field(default=None, repr=False)

    def start(self) -> None:
        if self.zygote is not None and self.env is not None:  # services: the env the supervisor built
            try:
                self.proc = self.zygote.spawn(self.argv, self.env, self.log_path)
                self.started_at = time.monotonic()
                log.info("started %s (pid %d, forked by the zygote)", self.name, self.proc.pid)
                return
            except ZygoteGone:
                self.zygote = None
        out = None
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log_file
        # A session of its own: Ctrl-C reaches only the supervisor, which stops services
        # before Redis and the broker (a terminal's SIGINT to the whole group would kill the
        # broker while workers still drain).
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the exited child's process group (its session: the group id
        is the child's pid; Linux does not reuse it while a member lives)."""
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return  # nothing left
        log.warning("%s: killed processes it left behind (its process group %d)", self.name, self.proc.pid)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM (if not sent yet), wait up to ``timeout_s``, then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing", self.name, timeout_s)
                self.proc.kill()
                self.proc.wait()
        self.kill_leftovers()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _host_port(addr: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(addr if "://" in addr else f"tcp://{addr}")
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


async def _wait_port(host: str, port: int, timeout_s: float, child: Child) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not _answers(host, port):
        if child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode} before listening on {port}")
        if loop.time() > deadline:
            raise RuntimeError(f"{child.name} did not listen on {host}:{port} within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def broker_child(host: str, port: int) -> Child:
    argv, env = embedded_broker.command(f"tcp://{host}:{port}")
    return Child("kafka(tansu)", argv, restart=False, env=env)


def redis_child(host: str, port: int) -> Child:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no Redis answers at redis_url and redis-server is not on PATH; install redis-server "
                           "or point MMFLEET_REDIS_URL at a Redis")
    argv = [binary, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no"]
    if host not in ("127.0.0.1", "localhost", "::1"):  # protected mode refuses every non-loopback client
        argv += ["--protected-mode", "no"]
    return Child("redis", argv, restart=False)


def worker_settings(settings: Settings, index: int) -> Settings:
    """Worker ``index``'s settings. A fixed metrics port would collide on one host, so worker i
    gets ``metrics_port + i``; 0 (ephemeral) stays 0 and each worker binds a free port."""
    if settings.metrics_port == 0:
        return settings
    return settings.with_overrides(metrics_port=settings.metrics_port + index)
