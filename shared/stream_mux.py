"""One blocking XREAD for every token stream a process follows (the gateway follows one per
request in flight), instead of one XREAD per stream per token.

Contract: ``subscribe(key)`` starts following ``key`` from its first entry and returns a
:class:`Subscription` whose ``entries`` fill in order as the reader sees them; ``event`` is set
whenever entries arrive or the reader fails (``error``). ``unsubscribe`` stops it. One follower
per key per process. A follower joining while the read blocks wakes it: every read also waits
on the process's wake stream (``wake_key``, one entry, expiring), and ``subscribe`` adds to it
(one round trip), so the next read includes the new key at once. A read that fails hands its
error to every subscription of that moment and ends them; later subscriptions start a new
reader. At most ``count`` entries per stream per read; a stream's entries are bounded by its
``MAXLEN``.
"""

from __future__ import annotations

import asyncio
import collections

import redis.asyncio as aioredis

__all__ = ["StreamMux", "Subscription"]


class Subscription:
    __slots__ = ("after", "entries", "event", "error")

    def __init__(self) -> None:
        self.after: bytes | str = "0-0"
        self.entries: collections.deque[tuple[bytes, dict]] = collections.deque()
        self.event = asyncio.Event()
        self.error: BaseException | None = None


class StreamMux:
    def __init__(self, redis: aioredis.Redis, wake_key: str, *, ttl_s: int, block_ms: int = 1000,
                 count: int = 256) -> None:
        self._redis = redis
        self._wake = wake_key.encode()
        self._ttl_s = ttl_s
        self._block_ms = block_ms
        self._count = count
        self._subs: dict[bytes, Subscription] = {}
        self._task: asyncio.Task | None = None

    async def subscribe(self, key: str) -> Subscription:
        k = key.encode()
        if k in self._subs:
            raise ValueError(f"{key} is followed already")
        sub = self._subs[k] = Subscription()
        if self._task is None:
            self._task = asyncio.create_task(self._read(), name="stream-mux")
        try:  # wakes a read blocked on the keys of before (one round trip)
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake, {b"w": b"1"}, maxlen=1, approximate=False)
                pipe.expire(self._wake, self._ttl_s)
                await pipe.execute()
        except BaseException:
            self.unsubscribe(key)
            raise
        return sub

    def unsubscribe(self, key: str) -> None:
        self._subs.pop(key.encode(), None)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read(self) -> None:
        try:
            while self._subs:
                asked = dict(self._subs)  # a key followed again meanwhile is a new subscription
                streams: dict[bytes, bytes | str] = {self._wake: "$"}
                streams.update((k, s.after) for k, s in asked.items())
                try:
                    reply = await self._redis.xread(streams, block=self._block_ms, count=self._count)
                except Exception as exc:  # noqa: BLE001 - every follower of this moment sees it
                    subs, self._subs = list(self._subs.values()), {}
                    for sub in subs:
                        sub.error = exc
                        sub.event.set()
                    return
                for key, entries in reply or ():
                    sub = self._subs.get(key)
                    if sub is None or sub is not asked.get(key) or not entries:  # the wake stream, a follower gone
                        continue
                    sub.after = entries[-1][0]
                    sub.entries.extend(entries)
                    sub.event.set()
        finally:
            if self._task is asyncio.current_task():
                self._task = None
