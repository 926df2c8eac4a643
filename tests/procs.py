"""Processes for tests: a real Kafka-compatible broker, a real redis-server and the fleet, each on
free ports, each stopped and reaped by its owner (no process outlives the test session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

# the harness and the tests start brokers, redis-servers and check children the same way
from loadtest.procs import (  # noqa: F401
    alive,
    argv_of,
    broker,
    children_of,
    free_port,
    redis_server,
    wait_port,
    worker_count,
)

REPO = Path(__file__).resolve().parents[1]


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def fleet(env_overrides: dict[str, str], log_dir: Path, *, mode: str = "e-p-d", ready_timeout_s: float = 240,
          up_args: tuple[str, ...] = ()):
    """``mmfleet up`` (+ ``up_args``) as a subprocess; yields (base_url, supervisor Popen)."""
    proc, base, ready_file = start_up(env_overrides, log_dir, mode=mode, up_args=up_args)
    try:
        wait_up(ready_file, proc, ready_timeout_s, log_dir)
        yield base, proc
    finally:
        stop_up(proc)


def start_up(env_overrides: dict[str, str], log_dir: Path, *, mode: str = "e-p-d", up_args: tuple[str, ...] = (),
             log_name: str = "supervisor.log") -> tuple[subprocess.Popen, str, Path]:
    """``mmfleet up`` started, not waited for: (its Popen, its base URL, the file it writes once ready).
    The gateway port is a free one unless ``env_overrides`` names one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMFLEET_")}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "MMFLEET_GATEWAY_PORT": str(free_port())})
    env.update(env_overrides)
    port = int(env["MMFLEET_GATEWAY_PORT"])
    ready_file = log_dir / f"ready-{port}-{log_name}"
    with open(log_dir / log_name, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--mode", mode, "--log-dir",
                                 str(log_dir), "--ready-file", str(ready_file), *up_args], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", ready_file


def stop_up(proc: subprocess.Popen) -> None:
    """Stop a supervisor and make sure none of its children outlive it."""
    kids = children_of(proc.pid)
    stop(proc, timeout_s=60)
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [k for k in kids if alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert not left, f"fleet children still alive after stop: {left}"


def wait_up(ready_file: Path, proc: subprocess.Popen, timeout_s: float, log_dir: Path,
                log_name: str = "supervisor.log") -> None:
    """Until ``mmfleet up`` says every stage serves (it writes ``ready_file``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mmfleet up exited with {proc.returncode}; logs in {log_dir}:\n"
                               + (log_dir / log_name).read_text()[-4000:])
        if ready_file.exists():
            return
        time.sleep(0.2)
    raise RuntimeError(f"fleet not ready after {timeout_s} s; logs in {log_dir}")


@asynccontextmanager
async def in_process_gateway(settings):
    """The gateway app in this process on a free port (its topics created first); yields its
    base URL. Imported here, not at module level: most tests that import this module start
    processes and never need the gateway's imports."""
    from aiohttp import web

    from services.gateway.app import create_app
    from services.stages import fleet_topics
    from shared.transport.bus import ensure_topics

    await ensure_topics(settings, fleet_topics(settings))
    runner = web.AppRunner(create_app(settings))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
