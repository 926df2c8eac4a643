"""CPU the target spends, idle and under load, beside the latency it buys (psutil).

A target's processes: its root and every descendant, plus for fleets the broker and Redis the
harness started (counted for whichever fleet runs at the time). Figures are percent of ONE
core. Under load the window also splits CPU ms per finished request by process role
(:func:`by_process_md`) and each Python process's CPU by thread class (:func:`thread_class`:
event loop, compute lanes, the rest; :func:`by_thread_md`), so messaging shows apart from model
work, and counts context switches per request (:func:`switches_md`; Linux): every hop of a
fleet is a wake-up of another process, dear on a VM. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import time

from loadtest.mdtable import runs_header
from loadtest.procs import argv_of
from shared.process.compute import LANE_THREAD_PREFIX

try:
    import psutil
except ImportError:  # the bench extra is not installed: CPU figures are left out ("–")
    psutil = None

INFRA_NAMES = ("tansu", "redis-server")
LOOP, COMPUTE, OTHER = "event loop", "compute", "other threads"
_CLASSES = (LOOP, COMPUTE, OTHER)  # thread_class's answers, in the order tables show them
_WHOLE = ("broker", "redis", "gone")  # roles whose threads are not split (not Python processes of ours)


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
    ``supervisor``, ``zygote``, ``broker``, ``redis``, ``inproc``, else its name."""
    try:
        name, argv = p.name(), argv_of(p.pid)
    except psutil.Error:
        return "gone"
    if "tansu" in name:
        return "broker"
    if "redis-server" in name:
        return "redis"
    if "shared.engines.decode_core_main" in argv:
        return "decode core"
    if "shared.process.zygote_main" in argv:
        return "zygote"
    if "services.cli" in argv:
        verb = argv[argv.index("services.cli") + 1:][:1]
        if verb == ["worker"] and "--stages" in argv:
            return "worker " + argv[argv.index("--stages") + 1]
        return {"up": "supervisor"}.get(verb[0], verb[0]) if verb else "cli"
    if "loadtest" in argv and "inproc" in argv:
        return "inproc"
    return name


def thread_class(role: str, pid: int, tid: int, os_name: str) -> str:
    """A thread's class: a compute lane (``shared.process.compute``: its OS name) or the decode core's
    main thread, which runs the model; the main thread of any other process, its event loop;
    anything else (NIXL's and UCX's threads, tokenizers, executors)."""
    if os_name.startswith(LANE_THREAD_PREFIX) or (role == "decode core" and tid == pid):
        return COMPUTE
    return LOOP if tid == pid else OTHER


def _threads(p) -> dict[int, tuple[str, float]]:
    """tid -> (OS name, CPU seconds) of ``p``'s live threads; empty where psutil or /proc cannot say.

    A thread's CPU comes from its ``schedstat`` (nanoseconds) where the kernel has it: psutil's
    per-thread times are whole clock ticks (10 ms), and a small window's lane could read 0."""
    out = {}
    try:
        for t in p.threads():
            task = f"/proc/{p.pid}/task/{t.id}"
            try:
                with open(f"{task}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = ""
            try:
                with open(f"{task}/schedstat") as f:
                    sec = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                sec = t.user_time + t.system_time
            out[t.id] = (name, sec)
    except (psutil.Error, OSError):
        return {}
    return out


def _switches(p) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of ``p``'s live threads; (0, 0) where /proc
    cannot say. Per thread: a process's own /proc status counts its main thread only."""
    vol = invol = 0
    try:
        tids = [t.id for t in p.threads()]
    except (psutil.Error, OSError):
        return 0, 0
    for tid in tids:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return vol, invol


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
        self.by_thread_s: dict[str, dict[str, float]] = {}  # process_role -> thread_class -> CPU seconds
        self.switches: dict[str, list[int]] = {}  # process_role -> [voluntary, involuntary] over the window
        self.wall_s = 0.0

    def __enter__(self) -> CpuWindow:
        self._c0 = [_seconds(p) for p in self._procs]
        self._roles = [process_role(p) for p in self._procs]
        self._t0_threads = [{} if role in _WHOLE else _threads(p) for p, role in zip(self._procs, self._roles,
                                                                                   strict=True)]
        self._sw0 = [_switches(p) for p in self._procs]
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = wall = time.monotonic() - self._t0
        if not self._procs:
            return
        for p, c0, role, before, sw0 in zip(self._procs, self._c0, self._roles, self._t0_threads, self._sw0,
                                            strict=True):
            self.by_role_s[role] = self.by_role_s.get(role, 0.0) + max(_seconds(p) - c0, 0.0)
            sw = self.switches.setdefault(role, [0, 0])
            for i, (n1, n0) in enumerate(zip(_switches(p), sw0, strict=True)):
                sw[i] += max(n1 - n0, 0)
            if role in _WHOLE:
                continue
            split = self.by_thread_s.setdefault(role, {})
            for tid, (name, sec) in _threads(p).items():
                cls = thread_class(role, p.pid, tid, name)
                split[cls] = split.get(cls, 0.0) + max(sec - before.get(tid, ("", 0.0))[1], 0.0)
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
           *runs_header(("process",), runs)]

    def cell(r: dict, role: str | None) -> str:
        by, ok, wall = r["cpu"]["by_process_s"], r["aggregates"]["ok"], r["cpu"].get("window_s") or 0
        sec = sum(by.values()) if role is None else by.get(role)
        if sec is None:
            return "–"
        return f"{1000 * sec / ok:.1f}" + (f" ({100 * sec / wall:.0f} %)" if wall else "")

    out += [f"| {role} | " + " | ".join(cell(r, role) for r in runs) + " |" for role in roles]
    out += ["| **all** | " + " | ".join(cell(r, None) for r in runs) + " |", ""]
    return out


def by_thread_md(runs: list[dict]) -> list[str]:
    """Per run: each process's CPU milliseconds per finished request by thread class (event loop,
    compute, other threads), the processes that have a split."""
    runs = [r for r in runs if (r.get("cpu") or {}).get("by_thread_s") and r["aggregates"].get("ok")]
    if not runs:
        return []
    rows = sorted({(role, cls) for r in runs for role, split in r["cpu"]["by_thread_s"].items() for cls in split},
                  key=lambda rc: (rc[0], _CLASSES.index(rc[1])))
    out = ["## CPU per request by thread", "",
           "The table above split by thread (Linux): each process's event loop (its main thread), its "
           "compute lanes (the decode core's main thread is its compute), and its other threads (NIXL, "
           "UCX, tokenizers, executors). A lane's job run inline (`compute_inline_max_ms`: on the event loop, "
           "its thread idle) counts as event loop. CPU milliseconds per finished request; the last row, the "
           "event loops' CPU over the compute's, moves little with the machine's speed at a fixed setting.", "",
           *runs_header(("process", "thread"), runs)]
    for role, cls in rows:
        cells = []
        for r in runs:
            sec = r["cpu"]["by_thread_s"].get(role, {}).get(cls)
            cells.append("–" if sec is None else f"{1000 * sec / r['aggregates']['ok']:.1f}")
        out.append(f"| {role} | {cls} | " + " | ".join(cells) + " |")
    totals = [_class_totals(r["cpu"]["by_thread_s"]) for r in runs]
    for cls in _CLASSES:
        cells = [f"{1000 * t[cls] / r['aggregates']['ok']:.1f}" for t, r in zip(totals, runs, strict=True)]
        out.append(f"| **all** | {cls} | " + " | ".join(cells) + " |")
    # the machine's speed moves every figure above from run to run, but not this ratio much: the
    # compute is the same work in every run, so it is the steadier way to compare messaging costs
    ratios = [f"{t[LOOP] / t[COMPUTE]:.2f}" if t[COMPUTE] > 0 else "–" for t in totals]
    out.append("| **all** | event loop ÷ compute | " + " | ".join(ratios) + " |")
    return out + [""]


def switches_md(runs: list[dict]) -> list[str]:
    """Per run: each process's context switches per finished request, voluntary / involuntary."""
    runs = [r for r in runs if (r.get("cpu") or {}).get("switches") and r["aggregates"].get("ok")]
    if not runs:
        return []
    roles = sorted({role for r in runs for role in r["cpu"]["switches"]},
                   key=lambda role: -max(r["cpu"]["switches"].get(role, [0, 0])[0] / r["aggregates"]["ok"]
                                         for r in runs))
    out = ["## Context switches per request by process", "",
           "Per finished request over each load window, every thread of each process (Linux): voluntary "
           "(the thread waited and was woken: a message arrived, a timer fired) / involuntary (preempted). "
           "A hop between processes costs wake-ups on both sides; threads that ended within the window are "
           "not counted.", "",
           *runs_header(("process",), runs)]

    def cell(r: dict, role: str | None) -> str:
        sw, ok = r["cpu"]["switches"], r["aggregates"]["ok"]
        if role is None:
            vol, invol = sum(v for v, _ in sw.values()), sum(i for _, i in sw.values())
        elif role in sw:
            vol, invol = sw[role]
        else:
            return "–"
        return f"{vol / ok:.1f} / {invol / ok:.1f}"

    out += [f"| {role} | " + " | ".join(cell(r, role) for r in runs) + " |" for role in roles]
    return out + ["| **all** | " + " | ".join(cell(r, None) for r in runs) + " |", ""]


def _class_totals(by_thread_s: dict[str, dict[str, float]]) -> dict[str, float]:
    """CPU seconds per thread class over every process of a run."""
    return {cls: sum(split.get(cls, 0.0) for split in by_thread_s.values()) for cls in _CLASSES}
