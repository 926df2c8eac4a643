"""The harness's CPU split by thread: a compute lane's thread is named for the OS, and a window
over a real process attributes its CPU to its event loop (main thread) and its compute lane."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loadtest import cpu
from shared.compute import LANE_THREAD_PREFIX

psutil = pytest.importorskip("psutil")
REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and /proc are Linux's")

# Spins a fixed amount of thread CPU time (not wall time: a busy machine only stretches it) on a
# compute lane and then on the main thread, says so, and waits to be told to exit.
_CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from shared.compute import ComputeLane

    def spin(cpu_s):
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass

    async def main():
        print("ready", flush=True)
        sys.stdin.readline()
        lane = ComputeLane("busy")
        await lane.run(spin, 0.6)
        spin(0.25)
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


@linux_only
def test_window_splits_a_real_process_into_loop_and_compute() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with cpu.CpuWindow(proc.pid, with_infra=False) as window:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (role,) = window.by_thread_s
    split = window.by_thread_s[role]
    assert split[cpu.COMPUTE] >= 0.55  # the lane spun 0.6 s of its own CPU time
    assert 0.2 <= split[cpu.LOOP] < split[cpu.COMPUTE]  # the main thread 0.25 s, plus the loop's own
    assert sum(split.values()) <= window.by_role_s[role] + 0.05  # the split never exceeds the process


def test_by_thread_md() -> None:
    runs = [
        {"target": "fleet:e-p-d", "label": "c=8", "aggregates": {"ok": 10},
         "cpu": {"by_thread_s": {"worker prefill": {cpu.LOOP: 0.1, cpu.COMPUTE: 0.05},
                                 "decode core": {cpu.COMPUTE: 0.2, cpu.OTHER: 0.001}}}},
        {"target": "inproc", "label": "c=8", "aggregates": {"ok": 20},
         "cpu": {"by_thread_s": {"inproc": {cpu.LOOP: 0.2, cpu.COMPUTE: 0.4}}}},
        {"target": "url:http://x", "label": "c=8", "aggregates": {"ok": 5}, "cpu": {"by_thread_s": {}}},
    ]
    md = "\n".join(cpu.by_thread_md(runs))
    assert "## CPU per request by thread" in md
    assert "| worker prefill | event loop | 10.0 | – |" in md
    assert "| decode core | compute | 20.0 | – |" in md
    assert "| inproc | compute | – | 20.0 |" in md
    assert "| **all** | event loop | 10.0 | 10.0 |" in md
    assert "| **all** | compute | 25.0 | 20.0 |" in md
    assert "| **all** | event loop ÷ compute | 0.40 | 0.50 |" in md
    assert "url:http://x" not in md  # a run with nothing to split has no column
    assert cpu.by_thread_md([runs[2]]) == []
