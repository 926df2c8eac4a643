"""One blocking XREAD for every token stream a process follows (the gateway follows one per
request in flight), instead of one XREAD per stream per token (:class:`StreamMux`).
``subscribe(key)`` follows ``key`` from its first entry: a :class:`Subscription` whose ``entries``
fill in order and whose ``event`` is set when entries arrive or the reader fails (``error``).
One follower per key per process. A read that fails hands its error to every subscription of
that moment and ends them; later subscriptions start a new reader.

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import redis.asyncio as aioredis

from shared.transport.redis_lean import LeanRedis, as_dict

__all__ = ["StreamMux", "Subscription"]

log = logging.getLogger(__name__)
WAKE_DELAY_S = 0.002


class Subscription:
    __slots__ = ("after", "entries", "event", "error")

    def __init__(self) -> None:
        self.after: bytes | str = "0-0"
        self.entries: collections.deque[tuple[bytes, dict]] = collections.deque()
        self.event = asyncio.Event()
        self.error: BaseException | None = None


class StreamMux:
    """A follower joining while the read blocks is in the next read; if no read has returned
    ``wake_delay_s`` after it joined, it wakes the one blocking: every read also waits on the
    process's wake stream (``wake_key``, one entry, expiring), and a wake adds to it (one round
    trip). Under load reads return every few ms, so joining costs nothing; a request's first event
    comes tens of ms after its follower joins (the stages run first), so the delay costs nothing
    either. At most ``count`` entries per stream per read; a stream's entries are bounded by its
    ``MAXLEN``."""

    def __init__(self, redis: aioredis.Redis, wake_key: str, *, ttl_s: int, block_ms: int = 1000,
                 count: int = 256, wake_delay_s: float = WAKE_DELAY_S) -> None:
        self._redis = redis
        self._reads = LeanRedis(redis)  # the blocking reads' own connection (wakes go through ``redis``)
        self._wake = wake_key.encode()
        self._ttl_s = ttl_s
        self._block_ms = block_ms
        self._count = count
        self._subs: dict[bytes, Subscription] = {}
        self._task: asyncio.Task | None = None
        self._wake_delay_s = wake_delay_s
        self._wake_timer: asyncio.TimerHandle | None = None  # armed while a follower waits for the next read
        self._waking: set[asyncio.Task] = set()
        self.wakes = 0  # wakes sent (their round trips begun), for tests and stats

    async def subscribe(self, key: str) -> Subscription:
        k = key.encode()
        if k in self._subs:
            raise ValueError(f"{key} is followed already")
        sub = self._subs[k] = Subscription()
        if self._task is None:  # the first read includes it
            self._task = asyncio.create_task(self._read(), name="stream-mux")
        elif self._wake_timer is None:  # a read blocks on the keys of before: the next one includes it
            self._wake_timer = asyncio.get_running_loop().call_later(self._wake_delay_s, self._wake_read)
        return sub

    def _wake_read(self) -> None:
        """No read returned since a follower joined: wake the one blocking (one round trip)."""
        self._wake_timer = None
        self.wakes += 1
        task = asyncio.create_task(self._send_wake(), name="stream-mux-wake")
        self._waking.add(task)
        task.add_done_callback(self._waking.discard)

    async def _send_wake(self) -> None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake, {b"w": b"1"}, maxlen=1, approximate=False)
                pipe.expire(self._wake, self._ttl_s)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the read fails too then, and its followers see why
            log.debug("stream mux: wake not sent: %r", exc)

    def unsubscribe(self, key: str) -> None:
        self._subs.pop(key.encode(), None)

    async def close(self) -> None:
        """Stop the reader; followers still subscribed get no more entries. (A later subscribe
        starts a new reader.)"""
        self._disarm()
        tasks = [t for t in [self._task, *self._waking] if t is not None]
        self._task = None
        for t in tasks:
            t.cancel()  # a read cancelled while it blocks drops its connection (LeanRedis)
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._reads.close()

    def _disarm(self) -> None:
        if self._wake_timer is not None:
            self._wake_timer.cancel()
            self._wake_timer = None

    async def _read(self) -> None:
        try:
            while self._subs:
                asked = dict(self._subs)  # a key followed again meanwhile is a new subscription
                self._disarm()  # every follower so far is in this read
                keys = [self._wake, *asked]
                try:
                    reply = await self._reads.call("XREAD", "COUNT", self._count, "BLOCK", self._block_ms, "STREAMS",
                                                   *keys, "$", *(s.after for s in asked.values()),
                                                   blocking_s=self._block_ms / 1000)
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
                    # as redis-py gives an entry: (id, {field: value}); a token log's entries have one field
                    sub.entries.extend((eid, as_dict(fv)) for eid, fv in entries)
                    sub.event.set()
        finally:
            if self._task is asyncio.current_task():
                self._task = None
                self._disarm()
