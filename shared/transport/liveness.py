"""Liveness records in Redis: who serves what right now, and where to scrape it.

A worker writes its ``WorkerInfo`` under ``keys.worker(id)`` with a TTL while every runner of it
holds partitions, and ``keys.alive(id)`` while its process runs; a gateway writes its
``GatewayInfo`` (its URL) under ``keys.gateway(id)`` while it listens. Each record is also listed
in an index (a sorted set by last write), so readers (the gateway's ``/ready``, the supervisor,
the fleet view, operators) read the records named there, never SCAN the keyspace: the cost is
the fleet's size, not Redis's. A record is deleted on a clean stop; a crashed process's expires
after ``ttl_s``. Design: docs/guide/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys

log = logging.getLogger(__name__)

# An index member not written for this long is dropped by the next reader. Far above any
# refresh interval, so clocks of writer and reader may disagree by as much without a live
# record dropping out; the record's own TTL says whether it is live.
INDEX_KEEP_MS = 300_000


async def keep_record(redis: aioredis.Redis, key: str, value: bytes, serving: Callable[[], bool], *,
                      interval_s: float = 2.0, ttl_s: float = 6.0, check_s: float = 0.1,
                      index: str | None = None) -> None:
    """Hold ``key`` = ``value`` (TTL ``ttl_s``) while ``serving()``, listed in the sorted set
    ``index`` when one is given; run until cancelled; always removes the record on the way out.
    ``serving()`` is looked at every ``check_s`` and a change is written at once (a worker shows
    up as soon as it holds partitions, not at the next refresh, and drops out as soon as it
    loses them); Redis is written every ``interval_s``."""
    loop = asyncio.get_running_loop()
    written: bool | None = None  # the state last sent to Redis (None: nothing yet)
    written_at = -float("inf")
    try:
        while True:
            now_serving = serving()
            if now_serving != written or loop.time() - written_at >= interval_s:
                written, written_at = now_serving, loop.time()
                try:
                    if now_serving:
                        await _write(redis, key, value, int(ttl_s * 1000), index)
                    else:
                        await _remove(redis, key, index)
                except (aioredis.RedisError, OSError) as exc:  # Redis restarting: again after interval_s
                    log.warning("could not refresh liveness record %s: %r", key, exc)
            await asyncio.sleep(check_s)
    finally:
        try:
            await asyncio.shield(_remove(redis, key, index))
        except (aioredis.RedisError, OSError):
            pass  # it expires within ttl_s


async def _write(redis: aioredis.Redis, key: str, value: bytes, ttl_ms: int, index: str | None) -> None:
    if index is None:
        await redis.set(key, value, px=ttl_ms)
        return
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(key, value, px=ttl_ms)
        pipe.zadd(index, {key: int(time.time() * 1000)})
        await pipe.execute()


async def _remove(redis: aioredis.Redis, key: str, index: str | None) -> None:
    if index is None:
        await redis.delete(key)
        return
    async with redis.pipeline(transaction=False) as pipe:
        pipe.delete(key)
        pipe.zrem(index, key)
        await pipe.execute()


async def heartbeat(redis: aioredis.Redis, keys: RedisKeys, info: protocol.WorkerInfo,
                    serving: Callable[[], bool], *, interval_s: float = 2.0, ttl_s: float = 6.0) -> None:
    """A worker's record (see :func:`keep_record`), and its ``alive`` key, held for as long as
    this runs whether it serves or not (what embedding-cache readers check an owner by)."""
    await asyncio.gather(
        keep_record(redis, keys.worker(info.worker_id), protocol.encode(info), serving,
                    interval_s=interval_s, ttl_s=ttl_s, index=keys.workers_index()),
        # nothing to watch for (it is held whatever happens): wake once a refresh, not every check_s
        keep_record(redis, keys.alive(info.worker_id), b"1", lambda: True, interval_s=interval_s, ttl_s=ttl_s,
                    check_s=interval_s))


async def _records(redis: aioredis.Redis, index: str, type_: type[msgspec.Struct]) -> list:
    """The live records listed in ``index`` (two round trips; members long unwritten are pruned)."""
    dec = protocol.decoder_for(type_)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(index, "-inf", int(time.time() * 1000) - INDEX_KEEP_MS)
        pipe.zrange(index, 0, -1)
        _, listed = await pipe.execute()
    if not listed:
        return []
    # a record listed but gone (expired: its holder crashed) is skipped; its member ages out
    return [dec.decode(raw) for raw in await redis.mget(listed) if raw is not None]


async def live_workers(redis: aioredis.Redis, keys: RedisKeys) -> list[protocol.WorkerInfo]:
    return await _records(redis, keys.workers_index(), protocol.WorkerInfo)


async def live_gateways(redis: aioredis.Redis, keys: RedisKeys) -> list[protocol.GatewayInfo]:
    return await _records(redis, keys.gateways_index(), protocol.GatewayInfo)
