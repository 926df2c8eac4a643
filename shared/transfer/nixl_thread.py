"""A NIXL agent whose UCX progress thread sleeps on UCX's event fd instead of spinning.

nixl's Python wrapper creates every agent with ``pthrDelay = 0``, and its UCX backend turns that
delay into the progress thread's ``poll()`` timeout (rounded up to whole ms): 0 means the thread
never sleeps, the busy core DESIGN.md measured. Given ``wake_ms`` > 0 the thread arms the
worker's event fd and sleeps in ``poll()`` until UCX has work or ``wake_ms`` passes, so a peer's
READ of this agent's memory is served at once without anything polling from Python. The
wrapper has no parameter for the delay, so the binding's agent constructor is wrapped for the
one call that creates the agent; if the wrapper's shape ever changes, the agent is created
without the thread (the caller's Python polling then drives progress) and a warning says so.
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
