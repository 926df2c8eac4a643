"""Worker liveness records in Redis: who serves which stages right now.

A worker writes its ``WorkerInfo`` under ``keys.worker(id)`` with a TTL while every runner of
it holds partitions, refreshing it every ``interval_s``; it deletes the record on a clean
stop, and a crashed worker's record expires after ``ttl_s``. Readers (the supervisor's
readiness check, operators) list live workers with :func:`live_workers`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys


async def heartbeat(redis: aioredis.Redis, keys: RedisKeys, info: protocol.WorkerInfo,
                    serving: Callable[[], bool], *, interval_s: float = 2.0, ttl_s: float = 6.0) -> None:
    """Run until cancelled; always removes the record on the way out."""
    key = keys.worker(info.worker_id)
    value = protocol.encode(info)
    try:
        while True:
            if serving():
                await redis.set(key, value, px=int(ttl_s * 1000))
            else:
                await redis.delete(key)
            await asyncio.sleep(interval_s)
    finally:
        await asyncio.shield(redis.delete(key))


async def live_workers(redis: aioredis.Redis, keys: RedisKeys) -> list[protocol.WorkerInfo]:
    dec = protocol.decoder_for(protocol.WorkerInfo)
    out = []
    async for key in redis.scan_iter(match=keys.workers_pattern(), count=100):
        raw = await redis.get(key)
        if raw is not None:  # expired between SCAN and GET
            out.append(dec.decode(raw))
    return out
