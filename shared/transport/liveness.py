"""Liveness records in Redis: who serves what right now, and where to scrape it.

A worker writes its ``WorkerInfo`` under ``keys.worker(id)`` with a TTL while every runner of it
holds partitions, and ``keys.alive(id)`` while its process runs; a gateway writes its
``GatewayInfo`` (its URL) under ``keys.gateway(id)`` while it listens. A record is deleted on a
clean stop; a crashed process's expires after ``ttl_s``. Readers (the supervisor's readiness
check, operators, tests) list them with :func:`live_workers` and :func:`live_gateways`.

Design: docs/guide/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys

log = logging.getLogger(__name__)


async def keep_record(redis: aioredis.Redis, key: str, value: bytes, serving: Callable[[], bool], *,
                      interval_s: float = 2.0, ttl_s: float = 6.0, check_s: float = 0.1) -> None:
    """Hold ``key`` = ``value`` (TTL ``ttl_s``) while ``serving()``; run until cancelled; always
    removes the record on the way out. ``serving()`` is looked at every ``check_s`` and a change
    is written at once (a worker shows up as soon as it holds partitions, not at the next
    refresh, and drops out as soon as it loses them); Redis is written every ``interval_s``."""
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
                        await redis.set(key, value, px=int(ttl_s * 1000))
                    else:
                        await redis.delete(key)
                except (aioredis.RedisError, OSError) as exc:  # Redis restarting: again after interval_s
                    log.warning("could not refresh liveness record %s: %r", key, exc)
            await asyncio.sleep(check_s)
    finally:
        try:
            await asyncio.shield(redis.delete(key))
        except (aioredis.RedisError, OSError):
            pass  # it expires within ttl_s


async def heartbeat(redis: aioredis.Redis, keys: RedisKeys, info: protocol.WorkerInfo,
                    serving: Callable[[], bool], *, interval_s: float = 2.0, ttl_s: float = 6.0) -> None:
    """A worker's record (see :func:`keep_record`), and its ``alive`` key, held for as long as
    this runs whether it serves or not (what embedding-cache readers check an owner by)."""
    await asyncio.gather(
        keep_record(redis, keys.worker(info.worker_id), protocol.encode(info), serving,
                    interval_s=interval_s, ttl_s=ttl_s),
        # nothing to watch for (it is held whatever happens): wake once a refresh, not every check_s
        keep_record(redis, keys.alive(info.worker_id), b"1", lambda: True, interval_s=interval_s, ttl_s=ttl_s,
                    check_s=interval_s))


async def _records(redis: aioredis.Redis, pattern: str, type_: type[msgspec.Struct]) -> list:
    dec = protocol.decoder_for(type_)
    out = []
    async for key in redis.scan_iter(match=pattern, count=100):
        raw = await redis.get(key)
        if raw is not None:  # expired between SCAN and GET
            out.append(dec.decode(raw))
    return out


async def live_workers(redis: aioredis.Redis, keys: RedisKeys) -> list[protocol.WorkerInfo]:
    return await _records(redis, keys.workers_pattern(), protocol.WorkerInfo)


async def live_gateways(redis: aioredis.Redis, keys: RedisKeys) -> list[protocol.GatewayInfo]:
    return await _records(redis, keys.gateways_pattern(), protocol.GatewayInfo)
