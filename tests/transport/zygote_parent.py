"""The parent side of tests/transport/test_zygote.py, in a process of its own (it becomes a
child subreaper, which a pytest process must not): ``python -m tests.transport.zygote_parent
MODEL_DIR WORK``. Starts a zygote, has it fork ``tests.transport.zygote_child`` a few ways, and
writes what it saw to WORK/parent.json; then keeps one child sleeping until it is killed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.process.zygote import Zygote, ZygoteGone, become_subreaper

CHILD = [sys.executable, "-m", "tests.transport.zygote_child"]

if __name__ == "__main__":
    model_dir, work = sys.argv[1], Path(sys.argv[2])
    become_subreaper()
    env = {**os.environ, "ZYGOTE_TEST_A": "1"}
    z = Zygote.start(env, work / "zygote.log", model_dir=model_dir,
                     preload=("shared.engines.transformers_engine:preload_family",))
    seen: dict = {"ready": z.wait_ready()}
    child_env = {**env, "ZYGOTE_TEST_B": "2"}
    child_env.pop("ZYGOTE_TEST_A")
    first = z.spawn([*CHILD, str(work / "first.json"), "3"], child_env, work / "first.log")
    seen["first"] = {"pid": first.pid, "returncode": first.wait(60)}
    sleeper = z.spawn([*CHILD, str(work / "sleeper.json"), "0", "60"], child_env, work / "sleeper.log")
    while not (work / "sleeper.json").exists():
        time.sleep(0.05)
    seen["sleeper_cmdline"] = Path(f"/proc/{sleeper.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    try:
        sleeper.wait(0.2)
        seen["sleeper_timeout"] = False
    except subprocess.TimeoutExpired:
        seen["sleeper_timeout"] = True
    sleeper.kill()
    seen["sleeper"] = {"pid": sleeper.pid, "returncode": sleeper.wait(10)}
    try:
        z.spawn(["/bin/true"], child_env, None)
        seen["not_python_m"] = "spawned"
    except ZygoteGone as exc:
        seen["not_python_m"] = str(exc)
    # a zygote forked from this very process (as a worker forks one for its decode core): what
    # it forks stays in this process's session and gets a descriptor by number
    from shared.process.zygote_main import fork_here

    here = fork_here()
    r, w = os.pipe()
    passed = here.spawn([*CHILD, str(work / "passed.json"), "5", "0", str(w)], child_env, None, new_session=False,
                        pass_fds=(w,))
    os.close(w)
    seen["passed"] = {"pid": passed.pid, "returncode": passed.wait(60), "read": os.read(r, 100).decode(),
                      "sid": os.getsid(0), "here": here.proc.pid}
    here.stop()
    seen["here_stopped"] = here.proc.returncode
    orphan = z.spawn([*CHILD, str(work / "orphan.json"), "0", "120"], child_env, work / "orphan.log")
    seen["orphan"] = orphan.pid
    while not (work / "orphan.json").exists():
        time.sleep(0.05)
    (work / "parent.json").write_text(json.dumps(seen))
    signal.pause()  # the test SIGKILLs us: the orphan must die with us
