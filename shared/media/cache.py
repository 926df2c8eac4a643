"""Fetched-bytes cache for media-fetch (:class:`FetchCache`): concurrent requests for one URL
share one download, and recent results are kept in an LRU bounded in bytes for ``ttl_s`` (URLs
are not immutable). Only successful fetches are cached; an error reaches every request waiting
on that download, and the next request tries again. A download is shielded from its waiters (one
cancelled waiter does not cancel it for the others) and ends within the fetch timeout. An item
larger than the whole capacity is served but not kept; ``max_bytes=0`` keeps nothing.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable

from cachetools import TTLCache


class FetchCache:
    def __init__(self, max_bytes: int, *, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: TTLCache[Hashable, bytes] = TTLCache(maxsize=max_bytes, ttl=ttl_s, timer=clock, getsizeof=len)
        self._inflight: dict[Hashable, asyncio.Task[bytes]] = {}
        self.hits = self.misses = self.joined = 0

    def __len__(self) -> int:
        self._entries.expire()
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    def get(self, key: Hashable) -> bytes | None:
        return self._entries.get(key)

    def put(self, key: Hashable, data: bytes) -> None:
        self._entries.pop(key, None)
        if len(data) <= self.max_bytes:  # a larger one is served, not kept
            self._entries[key] = data

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
