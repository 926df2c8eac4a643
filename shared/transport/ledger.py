"""Idempotent stages (:class:`StageLedger`): who is working on (request, stage, attempt), and
whether it is done, so a record Kafka delivers again (after a worker crash before its commit, or
a rebalance mid-work) is safe. ``claim`` is ``SET NX PX``: one worker at a time, refreshed while
it works, so a crashed holder's claim lapses within ``lease_ms``; ``mark_done`` after the outputs
are acknowledged, so a redelivered record whose work is done is acknowledged without redoing it.
A request restarted from its source runs every stage again under a fresh ``attempt`` from
``next_attempt`` (one counter per request: a number whose done-marks exist is never reused).

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import redis.asyncio as aioredis

from shared.keys import RedisKeys
from shared.transport.redis_conn import unavailable
from shared.transport.redis_lean import lean_of

log = logging.getLogger(__name__)

# delete / extend only if the claim is still ours (a lapsed claim may belong to another worker)
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# a fresh attempt number above ``current`` (the counter may be gone after a Redis flush)
_NEXT_ATTEMPT = """
local n = redis.call('incr', KEYS[1])
if n <= tonumber(ARGV[1]) then n = tonumber(ARGV[1]) + 1; redis.call('set', KEYS[1], n) end
redis.call('expire', KEYS[1], ARGV[2])
return n
"""
# enter (one round trip instead of three): aborted? (ARGV[3] == '1' only) done? else claim.
# 0 aborted, 1 done, 2 claimed, 3 held by another worker
_ENTER = """
if ARGV[3] == '1' and redis.call('exists', KEYS[1]) == 1 then return 0 end
if redis.call('exists', KEYS[2]) == 1 then return 1 end
if redis.call('set', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[2]) then return 2 end
return 3
"""
# finish (one round trip instead of two): the done-mark, then the claim released if still ours
_FINISH = """
redis.call('set', KEYS[1], '1', 'EX', ARGV[2])
if redis.call('get', KEYS[2]) == ARGV[1] then redis.call('del', KEYS[2]) end
return 1
"""
ABORTED, DONE, CLAIMED, HELD = 0, 1, 2, 3
_REFRESH = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"


class WriteGuard(NamedTuple):
    """What Redis must show for an early run's stream write to go before the run knows it may
    write: its claim (``claim_key`` holds ``owner``) and its record in Kafka (``acked_key``, set by
    the producer with its ack's ring, holds the record's ``partition``). See ``shared.transport.early``."""

    claim_key: str
    owner: str
    acked_key: str
    partition: int


class StageLedger:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, *, lease_ms: int, done_ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._lease_ms = lease_ms
        self._done_ttl_s = done_ttl_s
        self._release = redis.register_script(_RELEASE)
        self._refresh = redis.register_script(_REFRESH)
        self._next_attempt = redis.register_script(_NEXT_ATTEMPT)
        self._enter = redis.register_script(_ENTER)
        self._finish = redis.register_script(_FINISH)
        self._lean = lean_of(redis)  # enter and finish run per record and stage: the lean client's

    @property
    def lease_ms(self) -> int:
        return self._lease_ms

    def write_guard(self, request_id: str, stage: str, attempt: int, owner: str, topic: str,
                    partition: int) -> WriteGuard:
        """What Redis shows once ``owner`` holds the claim and the broker acked the stage's record
        (``topic``, ``partition``): an early run's guarded stream writes check it."""
        return WriteGuard(self._key(request_id, stage, attempt), owner, self._keys.acked(topic, request_id, attempt),
                          partition)

    def _key(self, request_id: str, stage: str, attempt: int) -> str:
        return self._keys.lease(request_id, f"{stage}#{attempt}")

    def _done_key(self, request_id: str, stage: str, attempt: int) -> str:
        return self._keys.done(request_id, f"{stage}#{attempt}")

    async def is_done(self, request_id: str, stage: str, attempt: int) -> bool:
        return bool(await self._redis.exists(self._done_key(request_id, stage, attempt)))

    async def claim(self, request_id: str, stage: str, attempt: int, owner: str) -> bool:
        return bool(await self._redis.set(self._key(request_id, stage, attempt), owner, nx=True,
                                          px=self._lease_ms))

    async def refresh(self, request_id: str, stage: str, attempt: int, owner: str) -> bool:
        return bool(await self._refresh(keys=[self._key(request_id, stage, attempt)], args=[owner, self._lease_ms]))

    async def release(self, request_id: str, stage: str, attempt: int, owner: str) -> None:
        await self._release(keys=[self._key(request_id, stage, attempt)], args=[owner])

    async def is_aborted(self, request_id: str) -> bool:
        return bool(await self._lean.call("EXISTS", self._keys.abort(request_id)))  # a decode's, every few tokens

    async def abort(self, request_id: str, ttl_s: int) -> None:
        await self._redis.set(self._keys.abort(request_id), b"1", ex=ttl_s)

    async def enter(self, request_id: str, stage: str, attempt: int, owner: str, *, check_abort: bool = True) -> int:
        """One round trip: ``ABORTED`` (the client went away; only with ``check_abort``),
        ``DONE``, ``CLAIMED`` (now ours) or ``HELD`` (another worker's live claim)."""
        return int(await self._lean.evalsha(self._enter, [self._keys.abort(request_id),
                                                          self._done_key(request_id, stage, attempt),
                                                          self._key(request_id, stage, attempt)],
                                            [owner, self._lease_ms, "1" if check_abort else "0"]))

    async def enter_waiting(self, request_id: str, stage: str, attempt: int, owner: str, *,
                            give_up_unix_ms: float, poll_s: float, check_abort: bool = True) -> int:
        """:meth:`enter`, waiting while another worker holds the claim (a holder that died
        lapses within the lease); ``HELD`` only once ``give_up_unix_ms`` has passed."""
        while True:
            state = await self.enter(request_id, stage, attempt, owner, check_abort=check_abort)
            if state != HELD or time.time() * 1000 > give_up_unix_ms:
                return state
            await asyncio.sleep(poll_s)

    def keeper(self, request_id: str, stage: str, attempt: int, owner: str) -> ClaimKeeper:
        """Refreshes a claim just taken every third of a lease until ``await keeper.stop()``; its
        task starts only once the first third has passed: most records are done long before, and
        a task made and cancelled per record and stage was two event-loop steps more for each."""
        return ClaimKeeper(self._lease_ms / 3000, lambda: self.refresh(request_id, stage, attempt, owner))

    async def finish(self, request_id: str, stage: str, attempt: int, owner: str) -> None:
        """``mark_done`` and ``release`` in one round trip."""
        await self._lean.evalsha(self._finish, [self._done_key(request_id, stage, attempt),
                                                self._key(request_id, stage, attempt)], [owner, self._done_ttl_s])

    async def mark_done(self, request_id: str, stage: str, attempt: int) -> None:
        await self._redis.set(self._done_key(request_id, stage, attempt), b"1", ex=self._done_ttl_s)

    async def next_attempt(self, request_id: str, current: int) -> int:
        """A fresh attempt number for the request, greater than ``current`` and than any number
        handed out before (while the counter lives, ``done_ttl_s``)."""
        return int(await self._next_attempt(keys=[self._keys.attempts(request_id)],
                                            args=[current, self._done_ttl_s]))

    async def broker_epoch(self) -> bytes | None:
        """The broker-epoch token (see ``RedisKeys.broker_epoch``); None when unset or flushed."""
        return await self._redis.get(self._keys.broker_epoch())

    async def broker_ready(self) -> bytes | None:
        """The broker-ready token (see ``RedisKeys.broker_ready``); None when unset or flushed."""
        return await self._redis.get(self._keys.broker_ready())


class ClaimKeeper:
    """A claim refreshed (``refresh()``) every ``every_s`` from ``every_s`` on: a timer until
    then, the refreshing task after it."""

    def __init__(self, every_s: float, refresh: Callable[[], Awaitable[bool]]) -> None:
        self._every_s, self._refresh = every_s, refresh
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(every_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.create_task(self._run(), name="claim-keeper")

    async def _run(self) -> None:
        while True:
            try:
                await self._refresh()
            except Exception as exc:
                if not unavailable(exc):
                    raise
                log.warning("claim not refreshed (%r); the work goes on, the claim may lapse", exc)
            await asyncio.sleep(self._every_s)

    @property
    def started(self) -> bool:
        return self._task is not None

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class EpochWatch:
    """Notices a change of a broker token (``RedisKeys.broker_epoch`` for consumers,
    ``broker_ready`` for the re-driver): a restarted broker that lost its records.
    :meth:`changed` is true once per change after the first token seen; an unset token (Redis
    flushed) or an unreachable Redis keeps the last one."""

    def __init__(self, read: Callable[[], Awaitable[bytes | None]]) -> None:
        self._read = read  # StageLedger.broker_epoch or broker_ready
        self._epoch: bytes | None = None

    async def changed(self) -> bool:
        try:
            epoch = await self._read()
        except Exception as exc:  # Redis away: check again next time
            log.debug("broker epoch check failed: %r", exc)
            return False
        if epoch is None or epoch == self._epoch:
            return False
        first, self._epoch = self._epoch is None, epoch
        return not first
