"""shared/process/gcpolicy.py in a fresh interpreter (it changes process-wide collector state): no
automatic collection while a process starts, start-up's heap frozen and the collector back on
once it serves, the heap frozen again at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.procs import REPO

SCRIPT = textwrap.dedent("""
    import gc
    from shared.process import gcpolicy

    runs = []
    gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
    gcpolicy.starting()
    assert not gc.isenabled()
    kept = []
    for _ in range(200_000):  # far past every generation's threshold: would collect if enabled
        a, b = [], []
        a.append(b); b.append(a)  # a cycle, garbage at once
        kept.append(object())
    assert runs == [], runs
    gcpolicy.serving()
    assert gc.isenabled() and gc.get_freeze_count() > 200_000
    gcpolicy.serving()  # idempotent: nothing refrozen, still on
    assert gc.isenabled()
    for _ in range(50_000):
        a, b = [], []
        a.append(b); b.append(a)
    assert runs, "the collector did not run after serving()"
    gc.unfreeze()  # so the exit hook has something to freeze again
    gc.callbacks.append(lambda phase, info: print("final", gc.get_freeze_count(), flush=True)
                        if phase == "start" and info["generation"] == 2 else None)
    print("ok", flush=True)
""")


def test_collector_off_while_starting_on_and_frozen_once_serving_frozen_at_exit():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "ok"
    # the interpreter's final collection runs, and finds the heap frozen by the exit hook
    finals = [int(n) for tag, n in zip(lines, lines[1:]) if tag == "final"]
    assert finals and all(n > 100_000 for n in finals), out.stdout
