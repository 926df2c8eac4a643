"""The harness's CPU split by thread: a compute lane's thread is named for the OS, and a window
over a real process attributes its CPU to its event loop (main thread) and its compute lane."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loadtest import cpu
from shared.process.compute import LANE_THREAD_PREFIX

psutil = pytest.importorskip("psutil")
REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and /proc are Linux's")

# Spins a fixed amount of thread CPU time (not wall time: a busy machine only stretches it) on a
# compute lane and then on the main thread (seconds: argv 1 and 2), says so, and waits to be told to exit.
_CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from shared.process.compute import ComputeLane

    def spin(cpu_s):
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass

    async def main():
        print("ready", flush=True)
        sys.stdin.readline()
        lane = ComputeLane("busy")
        await lane.run(spin, float(sys.argv[1]))
        spin(float(sys.argv[2]))
        print("done", flush=True)
        sys.stdin.readline()
        lane.close()  # only now: the lane's thread must outlive the window to be counted

    asyncio.run(main())
""")


def test_thread_class() -> None:
    assert cpu.thread_class("worker prefill", 10, 10, "python") == cpu.LOOP
    assert cpu.thread_class("worker prefill", 10, 11, LANE_THREAD_PREFIX + "transforme") == cpu.COMPUTE
    assert cpu.thread_class("worker prefill", 10, 12, "python") == cpu.OTHER
    assert cpu.thread_class("gateway", 20, 21, "tokio-rt") == cpu.OTHER
    # the decode core's main thread runs the model: compute, not an event loop
    assert cpu.thread_class("decode core", 30, 30, "python") == cpu.COMPUTE
    assert cpu.thread_class("decode core", 30, 31, "python") == cpu.OTHER


def _window_over(script: str, args: list[str], drive) -> cpu.CpuWindow:
    """A window over a child running ``script`` (it says "ready", then waits for ``drive(proc)``
    inside the window, then exits when told), the child reaped whatever happens."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with cpu.CpuWindow(proc.pid, with_infra=False) as window:
            drive(proc)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return window


def _window(lane_s: float, main_s: float) -> cpu.CpuWindow:
    """A window over a child that spins ``lane_s`` on a compute lane and ``main_s`` on its loop."""
    def drive(proc: subprocess.Popen) -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"

    return _window_over(_CHILD, [str(lane_s), str(main_s)], drive)


@linux_only
def test_window_splits_a_real_process_into_loop_and_compute() -> None:
    window = _window(0.6, 0.25)
    (role,) = window.by_thread_s
    split = window.by_thread_s[role]
    assert split[cpu.COMPUTE] >= 0.55  # the lane spun 0.6 s of its own CPU time
    assert 0.2 <= split[cpu.LOOP] < split[cpu.COMPUTE]  # the main thread 0.25 s, plus the loop's own
    assert sum(split.values()) <= window.by_role_s[role] + 0.05  # the split never exceeds the process


@linux_only
def test_a_lane_busy_for_less_than_a_clock_tick_is_counted() -> None:
    """A few milliseconds of lane CPU (a small run's model work) shows as such, not as 0 or a
    whole 10 ms tick: the harness's test asserted a small inproc run's compute > 0 and read 0."""
    split = _window(0.004, 0.0).by_thread_s
    (role,) = split
    assert 0.004 <= split[role][cpu.COMPUTE] < 0.0095


# Blocks on its stdin for each of N lines (a wake-up each) on a thread of its own, then for N
# more on its main thread, the first thread still alive, and waits to be told to exit.
_WAITER = textwrap.dedent("""
    import sys, threading

    def wait_lines(n):
        for _ in range(n):
            sys.stdin.readline()

    print("ready", flush=True)
    n = int(sys.argv[1])
    done, stay = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (wait_lines(n), done.set(), stay.wait()))
    t.start()
    done.wait()
    print("half", flush=True)
    wait_lines(n)
    print("done", flush=True)
    sys.stdin.readline()
    stay.set()
    t.join()
""")


def _feed(proc: subprocess.Popen, lines: int) -> None:
    for _ in range(lines):
        proc.stdin.write("x\n")
        proc.stdin.flush()
        time.sleep(0.01)  # the reader is asleep again before the next line


@linux_only
def test_window_counts_the_wake_ups_of_every_thread() -> None:
    """Each line the child waits for is a voluntary switch of the thread that waited. Half of
    them are its second thread's: a count of the main thread's alone (what a process's own
    /proc status gives) would come to about n, not 2n."""
    n = 30

    def drive(proc: subprocess.Popen) -> None:
        _feed(proc, n)
        assert proc.stdout.readline().strip() == "half"
        _feed(proc, n)
        assert proc.stdout.readline().strip() == "done"

    window = _window_over(_WAITER, [str(n)], drive)
    (role,) = window.switches
    vol, invol = window.switches[role]
    assert vol >= 1.5 * n and invol >= 0


def test_switches_table() -> None:
    runs = [{"target": "fleet:e-p-d", "label": "c=8", "aggregates": {"ok": 10},
             "cpu": {"switches": {"broker": [500, 100], "gateway": [140, 150]}}},
            {"target": "inproc", "label": "c=8", "aggregates": {"ok": 20}, "cpu": {"switches": {"inproc": [20, 40]}}},
            {"target": "url:x", "label": "c=8", "aggregates": {"ok": 5}, "cpu": {"switches": {}}}]
    table = cpu.switches_md(runs)
    assert table[0] == "## Context switches per request by process"
    rows = {line.split(" | ")[0]: line for line in table if line.startswith("| ")}
    assert rows["| broker"] == "| broker | 50.0 / 10.0 | – |"  # most wake-ups first; a url: target has no column
    assert rows["| inproc"] == "| inproc | – | 1.0 / 2.0 |"
    assert rows["| **all**"] == "| **all** | 64.0 / 25.0 | 1.0 / 2.0 |"
    assert [line.split(" | ")[0] for line in table if line.startswith("| ") and "---" not in line][1:] == \
        ["| broker", "| gateway", "| inproc", "| **all**"]
    assert cpu.switches_md([runs[2]]) == []
