"""A supervised child that dies by SIGKILL leaves nothing behind: what it had started in its
process group (a vLLM engine core, here a plain ``sleep``) is killed before it is restarted."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from services.supervisor import Child

# a child that starts a grandchild in its own process group and reports its pid
SCRIPT = ("import subprocess, time; g = subprocess.Popen(['sleep', '300']); print(g.pid, flush=True); "
          "time.sleep(300)")


def test_leftovers_of_a_killed_child_are_killed(tmp_path: Path):
    log = tmp_path / "child.log"
    child = Child("worker-test", [sys.executable, "-c", SCRIPT], restart=True, log_path=log)
    child.start()
    grandchild = None
    try:
        deadline = time.monotonic() + 20
        while grandchild is None and time.monotonic() < deadline:
            text = log.read_text().strip()
            grandchild = int(text) if text else None
            time.sleep(0.05)
        assert grandchild is not None
        assert os.getpgid(grandchild) == child.proc.pid  # the child's session, not ours
        child.kill_leftovers()  # still running: nothing is touched
        assert Path(f"/proc/{grandchild}").exists()
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
        assert Path(f"/proc/{grandchild}").exists()  # orphaned, as an engine core would be
        child.kill_leftovers()
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild)
        child.kill_leftovers()  # nothing left: a no-op
    finally:
        if grandchild is not None and _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        child.stop(1)


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its new parent's reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

