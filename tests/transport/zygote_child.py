"""A process for tests/transport/test_zygote.py to have the zygote fork (``python -m
tests.transport.zygote_child OUT CODE [SLEEP_S [FD]]``): writes what it sees of itself to OUT
as JSON (and a line to FD), sleeps SLEEP_S, then exits with CODE."""

import json
import os
import sys
import time

if __name__ == "__main__":
    out, code = sys.argv[1], int(sys.argv[2])
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv,
            "name": __name__, "torch_preloaded": "torch" in sys.modules,
            "transformers_preloaded": "transformers" in sys.modules,
            "env": {k: v for k, v in os.environ.items() if k.startswith("ZYGOTE_TEST")},
            "cwd": os.getcwd(), "threads": len(os.listdir("/proc/self/task"))}
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(out + ".tmp", out)
    print("child says hello", flush=True)  # to its log file
    if len(sys.argv) > 4:  # a descriptor it was passed, by number
        os.write(int(sys.argv[4]), b"through the passed descriptor")
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
    sys.exit(code)
