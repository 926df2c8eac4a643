"""The zygote (shared/process/zygote.py) with real processes: what it forks is the asking process's own
child (its exit status, including a signal's), runs its module as ``__main__`` with the
environment, log file, session and command line asked for, starts with torch and transformers
already imported, and dies with the asking process. The fleet runs on it by default (every e2e
test); tests/e2e/test_audio.py runs a fleet with it off."""

import json
import os
import signal
import subprocess
import sys
import time

from tests import procs


def test_forked_processes_are_the_parents_own_children(model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    parent = subprocess.Popen([sys.executable, "-m", "tests.transport.zygote_parent", str(model_dir), str(tmp_path)],
                              cwd=procs.REPO, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "parent.json").exists():
            assert parent.poll() is None, f"the parent exited with {parent.returncode}"
            assert time.monotonic() < deadline, "the zygote did not fork within 240 s"
            time.sleep(0.2)
        seen = json.loads((tmp_path / "parent.json").read_text())
        first = json.loads((tmp_path / "first.json").read_text())
        orphan = seen["orphan"]
        assert procs.alive(orphan)
        assert procs.argv_of(orphan)[-4:] == ["tests.transport.zygote_child", str(tmp_path / "orphan.json"), "0",
                                              "120"]
        parent.kill()  # SIGKILL: nothing of the parent's runs; the orphan's PR_SET_PDEATHSIG does
        parent.wait()
        deadline = time.monotonic() + 10
        while procs.alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not procs.alive(orphan), "a forked process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert seen["ready"] is True
    assert seen["first"] == {"pid": first["pid"], "returncode": 3}
    assert first["ppid"] == parent.pid  # adopted: the parent waits for it, as for a Popen child
    assert first["sid"] == first["pid"]  # a session of its own
    assert first["name"] == "__main__" and first["argv"][1:] == [str(tmp_path / "first.json"), "3"]
    assert first["torch_preloaded"] and first["transformers_preloaded"]
    assert first["env"] == {"ZYGOTE_TEST_B": "2"}  # exactly the environment asked for
    assert first["cwd"] == str(procs.REPO) and first["threads"] == 1
    assert (tmp_path / "first.log").read_text().splitlines()[0] == "child says hello"  # its stdout
    assert seen["sleeper_timeout"] is True
    assert seen["sleeper"]["returncode"] == -signal.SIGKILL
    assert seen["sleeper_cmdline"].endswith(f"-m tests.transport.zygote_child {tmp_path / 'sleeper.json'} 0 60")
    assert "not a `python -m` command line" in seen["not_python_m"]
    passed = json.loads((tmp_path / "passed.json").read_text())
    assert seen["passed"]["returncode"] == 5 and seen["passed"]["read"] == "through the passed descriptor"
    assert passed["ppid"] == parent.pid and passed["sid"] == seen["passed"]["sid"]  # not a session of its own
    assert passed["torch_preloaded"] is False  # forked from the parent as it was: nothing imported ahead
    assert seen["here_stopped"] == 0  # the forked zygote exits at its socket's EOF
