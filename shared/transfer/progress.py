"""Progress for a NIXL agent: an asyncio task calls ``poll`` (notifications, lease expiry, and
NIXL's own progress where the agent runs without its progress thread) every ``fast_s`` while
``busy()`` and every ``idle_s`` otherwise; :meth:`Progress.kick` cuts the current sleep short (a
new lease, a transfer, a release to send). Also the release-notification format that travels
between agents: ``b"rel:<id>,<id>,..."``, at most ``REL_CHUNK`` lease ids a message.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

# How often to poll with nothing in flight (an agent with NIXL's progress thread: peers' releases,
# slots freed a little later, and lease expiry). 20 cost each process ~50 polls a second, idle or
# under load.
IDLE_POLL_MS = 100.0
REL_PREFIX = b"rel:"
REL_CHUNK = 512  # lease ids per notification, keeps each message small


def release_notifs(leases: list[int]) -> Iterator[bytes]:
    """The notifications that release ``leases`` at their owner."""
    for i in range(0, len(leases), REL_CHUNK):
        yield REL_PREFIX + b",".join(b"%d" % int(x) for x in leases[i : i + REL_CHUNK])


def release_ids(msg: bytes) -> Iterator[int] | None:
    """The lease ids of a release notification, parsed as iterated (``ValueError`` at a
    malformed one); None for another kind of message."""
    if not msg.startswith(REL_PREFIX):
        return None
    return (int(part) for part in msg[len(REL_PREFIX) :].split(b","))


class Progress:
    def __init__(self, name: str, poll: Callable[[], None], busy: Callable[[], bool], *,
                 fast_s: float, idle_s: float) -> None:
        self._name = name
        self._poll = poll
        self._busy = busy
        self.fast_s = fast_s
        self._idle_s = idle_s
        self._task: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Launch the task (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"nixl-progress-{self._name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def kick(self) -> None:
        """Cut the current sleep short."""
        s = self._sleeper
        if s is not None and not s.done():
            s.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._poll()
            # A plain future + timer (not asyncio.sleep) so kick() can end the sleep early.
            fut: asyncio.Future[None] = loop.create_future()
            self._sleeper = fut
            timer = loop.call_later(self.fast_s if self._busy() else self._idle_s,
                                    lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                timer.cancel()
                self._sleeper = None
