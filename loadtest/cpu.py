"""CPU the target spends, idle and under load, beside the latency it buys (psutil).

A target's processes: its root process and every descendant (a fleet's supervisor, workers
and gateway; the inproc server), plus for fleets the broker and Redis the harness started
(children of this process named ``tansu`` / ``redis-server``, shared by the fleets of one
invocation, so they are counted for whichever fleet runs at the time). Figures are percent of
ONE core: CPU seconds (user + system) over the wall seconds of the window. Under load the
window also splits them by process role (``process_role``: a worker's stages, the gateway, the
broker, ...), reported as CPU milliseconds per finished request (:func:`by_process_md`).
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


def process_role(p) -> str:
    """What a target process is: ``worker <stages>``, ``decode core``, ``gateway``,
    ``supervisor``, ``broker``, ``redis``, ``inproc``, else its name."""
    try:
        name, argv = p.name(), p.cmdline()
    except psutil.Error:
        return "gone"
    if "tansu" in name:
        return "broker"
    if "redis-server" in name:
        return "redis"
    if "shared.engines.decode_core_main" in argv:
        return "decode core"
    if "services.cli" in argv:
        verb = argv[argv.index("services.cli") + 1:][:1]
        if verb == ["worker"] and "--stages" in argv:
            return "worker " + argv[argv.index("--stages") + 1]
        return {"up": "supervisor"}.get(verb[0], verb[0]) if verb else "cli"
    if "loadtest" in argv and "inproc" in argv:
        return "inproc"
    return name


def _seconds(p) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


class CpuWindow:
    """``with`` a window: ``pct`` = the processes' CPU over it, percent of one core."""

    def __init__(self, pid: int | None, *, with_infra: bool) -> None:
        self._procs = target_processes(pid, with_infra=with_infra)
        self.pct: float | None = None
        self.by_role_s: dict[str, float] = {}  # CPU seconds over the window by process_role
        self.wall_s = 0.0

    def __enter__(self) -> CpuWindow:
        self._c0 = [_seconds(p) for p in self._procs]
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = wall = time.monotonic() - self._t0
        if not self._procs:
            return
        for p, c0 in zip(self._procs, self._c0, strict=True):
            role = process_role(p)
            self.by_role_s[role] = self.by_role_s.get(role, 0.0) + max(_seconds(p) - c0, 0.0)
        self.pct = round(100 * sum(self.by_role_s.values()) / wall, 1) if wall > 0 else None


async def idle_pct(pid: int | None, seconds: float, *, with_infra: bool) -> float | None:
    """CPU of the target while no request is in flight, over ``seconds``."""
    if pid is None or seconds <= 0 or psutil is None:
        return None
    with CpuWindow(pid, with_infra=with_infra) as w:
        await asyncio.sleep(seconds)
    return w.pct


def by_process_md(runs: list[dict]) -> list[str]:
    """Per run (target at load level): CPU milliseconds per finished request, by process role;
    a fleet's CPU per request against the in-process server's is its throughput ceiling on a
    machine its load saturates."""
    runs = [r for r in runs if (r.get("cpu") or {}).get("by_process_s") and r["aggregates"].get("ok")]
    if not runs:
        return []
    roles = sorted({role for r in runs for role in r["cpu"]["by_process_s"]},
                   key=lambda role: -max(r["cpu"]["by_process_s"].get(role, 0) / r["aggregates"]["ok"] for r in runs))
    out = ["## CPU per request by process", "",
           "CPU milliseconds (user + system) per finished request over each load window, by process "
           "(fleets: + the broker and Redis the harness started); percent of one core in brackets.", "",
           "| process | " + " | ".join(f"`{r['target']}` {r['label']}" for r in runs) + " |",
           "|---|" + "---:|" * len(runs)]

    def cell(r: dict, role: str | None) -> str:
        by, ok, wall = r["cpu"]["by_process_s"], r["aggregates"]["ok"], r["cpu"].get("window_s") or 0
        sec = sum(by.values()) if role is None else by.get(role)
        if sec is None:
            return "–"
        return f"{1000 * sec / ok:.1f}" + (f" ({100 * sec / wall:.0f} %)" if wall else "")

    out += [f"| {role} | " + " | ".join(cell(r, role) for r in runs) + " |" for role in roles]
    out += ["| **all** | " + " | ".join(cell(r, None) for r in runs) + " |", ""]
    return out
