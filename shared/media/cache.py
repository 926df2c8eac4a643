"""Fetched-bytes cache for media-fetch: concurrent requests for one URL share one download
(in-flight de-duplication), and recent results are kept in an LRU bounded in bytes.

- Only successful fetches are cached; an error reaches every request that was waiting on that
  download (each gets it with its own param prefix) and the next request tries again.
- A download is shielded from its waiters: one waiter being cancelled (client gone, drain)
  does not cancel the download the others wait on. It still ends within the fetch timeout.
- Entries expire after ``ttl_s`` (URLs are not immutable); an item larger than the whole
  capacity is served but not kept. ``max_bytes=0`` turns caching off (de-duplication stays).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable


class FetchCache:
    def __init__(self, max_bytes: int, *, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[Hashable, tuple[float, bytes]] = OrderedDict()
        self._inflight: dict[Hashable, asyncio.Task[bytes]] = {}
        self.bytes = 0
        self.hits = self.misses = self.joined = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, data = entry
        if self._clock() - stored_at > self.ttl_s:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return data

    def put(self, key: Hashable, data: bytes) -> None:
        if key in self._entries:
            self._drop(key)
        if len(data) > self.max_bytes:
            return
        while self.bytes + len(data) > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (self._clock(), data)
        self.bytes += len(data)

    def _drop(self, key: Hashable) -> None:
        _, data = self._entries.pop(key)
        self.bytes -= len(data)

    async def get_or_fetch(self, key: Hashable, fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        """Cached bytes for ``key``, else the result of the one running ``fetch()`` for it."""
        data = self.get(key)
        if data is not None:
            self.hits += 1
            return data
        task = self._inflight.get(key)
        if task is None:
            self.misses += 1
            task = asyncio.ensure_future(self._run(key, fetch))
            self._inflight[key] = task
            task.add_done_callback(_consume)
        else:
            self.joined += 1
        return await asyncio.shield(task)

    async def _run(self, key: Hashable, fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        try:
            data = await fetch()
            self.put(key, data)
            return data
        finally:
            self._inflight.pop(key, None)


def _consume(task: asyncio.Task) -> None:
    """Retrieve a download's exception when every waiter left (no 'never retrieved' noise)."""
    if not task.cancelled():
        task.exception()
