"""A NIXL agent whose UCX progress thread sleeps on UCX's event fd instead of spinning.
nixl's Python wrapper creates every agent with ``pthrDelay = 0``, which its UCX backend turns into
the progress thread's ``poll()`` timeout: the thread never sleeps and keeps a core busy. Given
``wake_ms`` > 0 the thread sleeps in ``poll()`` until UCX has work or ``wake_ms`` passes, so a
peer's READ is served at once without Python polling. The wrapper has no parameter for it, so
its constructor is wrapped for one call; if its shape changes, the agent runs without the thread
(Python polling drives progress) and a warning says so.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

try:  # the meta package's import path, else the variant wheel the project pins
    from nixl import _api
except ImportError:
    from nixl_cu12 import _api

log = logging.getLogger(__name__)
_lock = threading.Lock()  # the wrapper's module attribute is swapped for one constructor call


def make_agent(name: str, *, wake_ms: int) -> tuple[object, bool]:
    """A UCX ``nixl_agent`` named ``name`` and whether it runs its own progress thread:
    ``wake_ms`` > 0 asks for the event-driven thread, 0 for none."""
    bind = getattr(_api, "nixlBind", None)
    if wake_ms <= 0 or bind is None or not hasattr(bind, "nixlAgent"):
        if wake_ms > 0:
            log.warning("nixl's wrapper changed: cannot set the progress thread's wake interval; "
                        "running %s without the thread (progress polled from Python)", name)
        return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False)), False

    def agent_with_delay(agent_name, config):
        config.pthrDelay = int(wake_ms) * 1000  # microseconds
        return bind.nixlAgent(agent_name, config)

    shim = SimpleNamespace(**{k: getattr(bind, k) for k in dir(bind) if not k.startswith("__")})
    shim.nixlAgent = agent_with_delay
    with _lock:
        _api.nixlBind = shim
        try:
            agent = _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"], enable_prog_thread=True))
        finally:
            _api.nixlBind = bind
    return agent, True
