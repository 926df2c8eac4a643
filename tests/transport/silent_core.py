"""A decode core that never gets ready: it holds its socket, says nothing, and exits 3 once the
file named by ``SILENT_CORE_UNTIL`` exists (or after a minute); see test_worker_boot.py."""

import os
import time

if __name__ == "__main__":
    until = os.environ["SILENT_CORE_UNTIL"]
    for _ in range(1200):
        if os.path.exists(until):
            break
        time.sleep(0.05)
    raise SystemExit(3)
