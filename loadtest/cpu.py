"""CPU the target spends, idle and under load, beside the latency it buys (psutil).

A target's processes: its root process and every descendant (a fleet's supervisor, workers
and gateway; the inproc server), plus for fleets the broker and Redis the harness started
(children of this process named ``tansu`` / ``redis-server``, shared by the fleets of one
invocation, so they are counted for whichever fleet runs at the time). Figures are percent of
ONE core: CPU seconds (user + system) over the wall seconds of the window.
"""

from __future__ import annotations

import asyncio
import time

try:
    import psutil
except ImportError:  # the bench extra is not installed: CPU figures are left out ("–")
    psutil = None

INFRA_NAMES = ("tansu", "redis-server")


def target_processes(pid: int | None, *, with_infra: bool) -> list:
    procs: list = []
    if psutil is None:
        return procs
    if pid is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
    if with_infra:
        procs += [p for p in psutil.Process().children() if any(n in p.name() for n in INFRA_NAMES)]
    return procs


def cpu_seconds(procs: list) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class CpuWindow:
    """``with`` a window: ``pct`` = the processes' CPU over it, percent of one core."""

    def __init__(self, pid: int | None, *, with_infra: bool) -> None:
        self._procs = target_processes(pid, with_infra=with_infra)
        self.pct: float | None = None

    def __enter__(self) -> CpuWindow:
        self._c0, self._t0 = cpu_seconds(self._procs), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._t0
        if not self._procs:
            return
        self.pct = round(100 * (cpu_seconds(self._procs) - self._c0) / wall, 1) if wall > 0 else None


async def idle_pct(pid: int | None, seconds: float, *, with_infra: bool) -> float | None:
    """CPU of the target while no request is in flight, over ``seconds``."""
    if pid is None or seconds <= 0 or psutil is None:
        return None
    with CpuWindow(pid, with_infra=with_infra) as w:
        await asyncio.sleep(seconds)
    return w.pct
