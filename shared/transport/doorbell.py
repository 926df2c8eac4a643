"""Doorbell: a Redis pub/sub nudge that tells an idle stage consumer to fetch now.

The embedded broker (tansu) never answers a waiting fetch when data arrives, so with the doorbell
on, consumers fetch with a 1 ms broker-side wait and, after an empty fetch, wait client-side for
a ring on their topic's channel or ``idle_fetch_interval_ms``. A ring is a wake-up, at most
carrying a copy of a record also produced to Kafka (``shared.transport.early``): Kafka stays the record of
truth, and a lost ring costs at most one idle interval. :class:`Doorbell` does both sides.

Design: docs/design/doorbell.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import TopicPartition
from redis.exceptions import ResponseError

from shared import protocol
from shared.keys import RedisKeys
from shared.process.aio import wait_event
from shared.transport.redis_conn import write_at_once

log = logging.getLogger(__name__)

_MAX_PENDING_RINGS = 64  # rings queued at most (carried copies: 64 KB each at most); beyond, a ring is dropped
_RECONNECT_S = 0.1
RING_CLIENT_NAME = "mmfleet-doorbell"  # the ring connection in CLIENT LIST
_REPLY_CHECK_S = 5.0  # how often the ring wire checks that the server really sends it no replies
_FIRST_REPLY_CHECK_S = 0.05  # the first check: after a new connection's replies, if any, have come
# How long after a ring a consumer keeps fetching: rings go out with the produce, before its ack
# (~1 ms on tansu), and a ring reaches the consumer ~0.5 ms after it is sent. Short, because
# every worker of the stage hears the ring and only one of them gets the record.
EXPECT_MS = 3.0
# An empty fetch answered with a highwater past the consumer's position (the broker has records it
# did not send: tansu answers a 1 ms-wait fetch so when its read misses that wait, seen on a slowed
# machine) is repeated at once, at most this many times in a row, instead of sleeping till a ring
_BEHIND_REPEATS = 3
# How long the key saying a carried record was acked lives: past any early run's wait for its
# record (early_start_confirm_ms, 5 s by default), which is all that reads it
ACKED_TTL_MS = 60_000


class _Bell:
    """One topic's ring counter and the event waiters sleep on."""

    def __init__(self, expect_s: float) -> None:
        self.rings = 0
        self.event = asyncio.Event()
        self.expect_s = expect_s
        self.expect_until = 0.0  # time.monotonic(): till then an empty fetch is repeated at once
        self.on_carried = None  # callback(bytes) for a ring's carried record (shared.transport.early)
        self.behind_repeats = 0  # empty fetches repeated in a row because the broker had more (_BEHIND_REPEATS)

    def ring(self) -> None:
        self.rings += 1
        self.expect_until = time.monotonic() + self.expect_s
        self.event.set()

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Return at once if a ring came after ``seen``, else at the next ring or ``timeout_s``."""
        if self.rings != seen:
            return
        self.event.clear()
        await wait_event(self.event, timeout_s)


class _RingWire:
    """PUBLISHes on one connection with ``CLIENT REPLY OFF``: a ring costs a socket write, where a
    pooled ``PUBLISH`` cost ~0.25 ms of the event loop (task, pool, reply parse). Rings queued
    while one write is under way go out together. A failed write drops the connection and the
    rings queued (a lost ring costs at most the idle interval); the next ring reconnects. A server
    that answers anyway (an ACL refusing ``CLIENT REPLY``: its replies would pile up unread) is
    noticed within ``_REPLY_CHECK_S`` and the rings go through the pool from then on. A ring sent
    while the connection is up and idle is written within ``send`` (:meth:`_write_now`)."""

    def __init__(self, redis) -> None:
        self._redis = redis
        self._conn = None
        self._queue: list[tuple[str, bytes, tuple[str, str] | None]] = []  # (channel, payload, acked key + value)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._check_at = 0.0
        self.pooled = False  # replies could not be turned off: rings are plain PUBLISH commands
        self.sent = 0
        self._writing = False  # the ring task is writing (or reconnecting): later rings queue behind it
        self._closed = False

    def send(self, channel: str, payload: bytes = b"", mark: tuple[str, str] | None = None) -> None:
        """``mark``: (key, value) to SET (``ACKED_TTL_MS``) in the same write, before the ring."""
        if self._closed or len(self._queue) >= _MAX_PENDING_RINGS or self._write_now(channel, payload, mark):
            return
        self._queue.append((channel, payload, mark))
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="doorbell-rings")

    def _write_now(self, channel: str, payload: bytes, mark: tuple[str, str] | None) -> bool:
        """Write the ring within this call when the connection is up and idle (nothing queued or
        being written, no reply check due): the ring task would write it a loop turn later, behind
        what is ready by then (the producer's own Kafka request first). False: queue it."""
        conn = self._conn
        if (conn is None or self.pooled or self._queue or self._writing
                or asyncio.get_running_loop().time() >= self._check_at
                or not write_at_once(conn, conn.pack_commands(_commands([(channel, payload, mark)])))):
            return False
        self.sent += 1
        return True

    async def _run(self) -> None:
        # ends on close() even when a cancel is lost: redis-py writes under asyncio.wait_for when the
        # pool sets a socket timeout, and on Python 3.11 that can swallow a cancel (close() hung)
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            rings, self._queue = self._queue, []
            self._writing = True
            try:
                if self.pooled:
                    for channel, payload, mark in rings:
                        if mark is not None:
                            await self._redis.set(mark[0], mark[1], px=ACKED_TTL_MS)
                        await self._redis.publish(channel, payload)
                else:
                    await self._write(rings)
                self.sent += len(rings)
            except Exception as exc:  # noqa: BLE001 - a ring is a hint; the idle interval covers its loss
                log.debug("doorbell rings %s lost: %r", [c for c, *_ in rings], exc)
                await self._drop()
                await asyncio.sleep(_RECONNECT_S)  # Redis away: not a connect attempt per ring
            finally:
                self._writing = False

    async def _write(self, rings: list[tuple[str, bytes, tuple[str, str] | None]]) -> None:
        loop = asyncio.get_running_loop()
        if self._conn is None:
            pool = self._redis.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            await conn.connect()  # AUTH / HELLO / TLS as the pool's own connections
            await conn.send_packed_command(conn.pack_commands([("CLIENT", "REPLY", "OFF"),
                                                               ("CLIENT", "SETNAME", RING_CLIENT_NAME)]),
                                           check_health=False)
            self._conn, self._check_at = conn, loop.time() + _FIRST_REPLY_CHECK_S
        await self._conn.send_packed_command(self._conn.pack_commands(_commands(rings)), check_health=False)
        if loop.time() >= self._check_at:
            self._check_at = loop.time() + _REPLY_CHECK_S
            if await self._conn.can_read():  # a reply, or the server closed the connection
                try:  # the latter raises ConnectionError: reconnect at the next ring
                    await self._conn.read_response()
                except ResponseError:  # e.g. NOPERM for CLIENT REPLY: a reply all the same
                    pass
                log.warning("doorbell: the Redis server still replies on the ring connection (is CLIENT REPLY "
                            "refused?); ringing with plain PUBLISH commands instead")
                self.pooled = True
                await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.disconnect()
            except Exception:  # noqa: BLE001 - already broken
                pass

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._drop()


def _behind(assignment, request) -> bool:
    """Whether the answer to ``request`` (aiokafka's FetchRequest) left a fetched partition's
    highwater past the consumer's position: records the broker has and did not send."""
    for topic, partitions in request.topics:
        for partition, *_ in partitions:
            try:
                state = assignment.state_value(TopicPartition(topic, partition))
            except (KeyError, AttributeError):  # no longer assigned
                continue
            if (state is not None and state.has_valid_position and state.highwater is not None
                    and state.highwater > state.position):
                return True
    return False


def _commands(rings: list[tuple[str, bytes, tuple[str, str] | None]]) -> list[tuple]:
    out: list[tuple] = []
    for channel, payload, mark in rings:
        if mark is not None:
            out.append(("SET", mark[0], mark[1], "PX", ACKED_TTL_MS))
        out.append(("PUBLISH", channel, payload))
    return out


class Doorbell:
    """Per process: rings topics (publisher) and wakes this process's consumers (subscriber).

    :meth:`ring` is called as a produce to the topic goes out, before the broker's ack (so the
    next stage fetches while the broker acks), and again once acked if that was :meth:`late`; it
    never raises and never blocks the caller. Rings are written on a connection of their own with
    replies off (:class:`_RingWire`): one socket write, not a pooled command whose reply is parsed.
    A ring may carry a copy of the record produced with it (``protocol.CarriedRecord``) and, once
    the broker acked it, a second one (``protocol.AckedRecord``, :meth:`ring_acked`)."""

    def __init__(self, redis, prefix: str, *, idle_fetch_interval_ms: int, expect_ms: float = EXPECT_MS) -> None:
        self._redis = redis
        self._prefix = prefix
        self._keys = RedisKeys(prefix)
        self._idle_s = idle_fetch_interval_ms / 1000
        self._expect_s = expect_ms / 1000
        self._bells: dict[str, _Bell] = {}
        self._wire = _RingWire(redis)
        self._listener: asyncio.Task | None = None
        self.rings_heard = 0  # for tests and stats

    def channel(self, topic: str) -> str:
        return f"{self._prefix}:doorbell:{topic}"

    def late(self, sent_monotonic: float) -> bool:
        """True when a produce sent (and rung) at ``sent_monotonic`` was acked too late for the
        consumers' expectation window: ring again."""
        return time.monotonic() - sent_monotonic > self._expect_s / 2

    # ------------------------------------------------------------------ publisher
    def ring(self, topic: str, carried: bytes = b"") -> None:
        """``carried``: an encoded ``protocol.RingPayload`` (a record just sent, or acked), or nothing."""
        self._wire.send(self.channel(topic), carried)

    def ring_acked(self, topic: str, acked: protocol.AckedRecord) -> None:
        """The ring for a carried record the broker acked: carries ``acked`` and sets
        ``RedisKeys.acked`` (its partition) in the same write, for ``ACKED_TTL_MS``: an early run's
        guarded stream write checks it in Redis (``shared.transport.ledger.WriteGuard``)."""
        key = self._keys.acked(topic, acked.request_id, acked.attempt)
        self._wire.send(self.channel(topic), protocol.encode(acked), (key, str(acked.partition)))

    @property
    def rings_sent(self) -> int:  # for tests and stats
        return self._wire.sent

    # ------------------------------------------------------------------ subscriber
    def on_carried(self, topic: str, callback) -> None:
        """Hand the records rings on ``topic`` carry to ``callback(payload: bytes)`` (called on the
        listener's task: it must not block); :meth:`attach` is still what makes a ring a wake-up,
        unless ``callback`` returns False for it (nothing to fetch: an ack for a record Kafka
        already delivered here, where waking would only send empty fetches for ``expect_ms``)."""
        self._bell(topic).on_carried = callback

    def _bell(self, topic: str) -> _Bell:
        bell = self._bells.get(topic)
        if bell is None:
            bell = self._bells[topic] = _Bell(self._expect_s)
        return bell

    def attach(self, consumer, topic: str) -> None:
        """Make ``consumer`` (started, fetch_max_wait_ms=1) wait for rings on ``topic`` after
        an empty fetch. Wraps aiokafka's fetcher method that sends one fetch request: its
        background routine calls it by attribute, once per fetch, never two to one broker at once.

        The ring counter is read before the fetch is sent, so a ring landing during the fetch is
        never missed. For ``expect_ms`` after a ring the record may still be on its way, so an
        empty fetch that began in that window is repeated at once until one returns records. The
        window is judged by when a fetch began, not when it came back: a fetch sent just before the
        record landed can come back empty after the window closed. A fetch that brings records
        ends the window even when a ring came during it (kept open, it kept every consumer
        fetching without pause under load)."""
        bell = self._bell(topic)
        fetcher = consumer._fetcher  # aiokafka 0.14 internals: see tests/transport/test_doorbell.py
        send_fetch = fetcher._proc_fetch_request
        idle_s = self._idle_s

        async def fetch_then_wait(assignment, node_id, request):
            seen, started = bell.rings, time.monotonic()
            got = await send_fetch(assignment, node_id, request)
            if got:
                bell.expect_until = 0.0  # what the ring announced has come
                bell.behind_repeats = 0
            elif started < bell.expect_until:
                # the fetch began inside the window: one that ends after it (the broker held it while
                # the record landed) is followed by one more, which the record, if acked in time, is in
                pass
            elif bell.behind_repeats < _BEHIND_REPEATS and _behind(assignment, request):
                bell.behind_repeats += 1  # the broker has records past our position: ask again now
            else:  # nothing on its way: sleep until a ring
                bell.behind_repeats = 0
                try:
                    await bell.wait(seen, idle_s)  # (or the idle interval), not broker-side
                except asyncio.CancelledError:
                    # consumer.stop() or an unassignment cancels this task and then awaits it: as
                    # aiokafka's own fetch does, end quietly (raising here escaped consumer.stop())
                    return got
            return got

        fetcher._proc_fetch_request = fetch_then_wait
        if self._listener is not None:  # (re)subscribe with the new topic's channel too
            self._listener.cancel()
        self._listener = asyncio.create_task(self._listen(), name="doorbell")

    async def _listen(self) -> None:
        """Subscribe to every attached topic's channel; reconnect with backoff on errors."""
        delay_s = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(*[self.channel(t) for t in self._bells])
                by_channel = {self.channel(t).encode(): b for t, b in self._bells.items()}
                delay_s = 0.1
                async for msg in pubsub.listen():
                    if msg.get("type") == "message" and (bell := by_channel.get(msg["channel"])) is not None:
                        self.rings_heard += 1
                        # the carried record first: its early run is then queued on the loop ahead
                        # of the fetch the ring wakes, and starts before that fetch is sent
                        wake = True
                        if msg["data"] and bell.on_carried is not None:
                            try:
                                wake = bell.on_carried(msg["data"]) is not False
                            except Exception:  # noqa: BLE001 - a carried copy is a hint: the record still comes
                                log.exception("doorbell: a carried record's handler failed")
                        if wake:
                            bell.ring()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away: consumers poll at the idle interval
                log.warning("doorbell subscriber lost Redis (%r); retrying in %.1f s", exc, delay_s)
                for bell in self._bells.values():  # wake sleepers once: something may have been missed
                    bell.ring()
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)
            finally:
                await pubsub.aclose()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        await self._wire.close()
