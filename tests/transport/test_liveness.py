"""Liveness records against a real redis-server: a change of ``serving()`` reaches Redis at once,
not at the next refresh (the supervisor's readiness and the fleet view read it), a record
lives on its TTL between refreshes, readers find a worker's through the index while it serves,
and a stopped holder leaves none behind."""

from __future__ import annotations

import asyncio

from shared import protocol
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.transport.liveness import heartbeat, keep_record, live_workers
from shared.transport.redis_conn import make_redis

LONG_INTERVAL_S = 60.0  # no refresh tick falls inside the test: what shows, the change wrote


async def _until(check, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_change_of_serving_is_written_at_once_and_the_record_goes_with_its_holder(redis_url):
    async def go():
        redis = make_redis(settings_mod.from_env({}, redis_url=redis_url))
        key = "liveness-test:worker:w1"
        state = {"serving": False}
        await redis.delete(key)
        task = asyncio.create_task(keep_record(redis, key, b"info", lambda: state["serving"],
                                               interval_s=LONG_INTERVAL_S, ttl_s=LONG_INTERVAL_S * 3))
        try:
            await asyncio.sleep(0.3)
            assert await redis.get(key) is None  # not serving yet: no record
            state["serving"] = True  # partitions assigned
            assert await _until(lambda: redis.exists(key), 10), "record not written after serving began"
            assert await redis.get(key) == b"info"
            assert 0 < await redis.pttl(key) <= LONG_INTERVAL_S * 3 * 1000
            state["serving"] = False  # partitions revoked
            assert await _until(lambda: _absent(redis, key), 10), "record kept after serving ended"
            state["serving"] = True
            assert await _until(lambda: redis.exists(key), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert await redis.get(key) is None  # a clean stop removes it
        await redis.aclose()

    asyncio.run(go())


async def _absent(redis, key: str) -> bool:
    return not await redis.exists(key)


def test_a_workers_alive_key_outlives_its_partitions_but_not_its_process(redis_url):
    """``heartbeat``: the ``worker`` record follows ``serving()``, the ``alive`` key (what the
    embedding index checks owners by) is held throughout and goes when the heartbeat stops."""
    async def go():
        redis = make_redis(settings_mod.from_env({}, redis_url=redis_url))
        keys = RedisKeys("liveness-alive-test")
        info = protocol.WorkerInfo(worker_id="w2", stages=("encode",), pid=1, host="h", started_unix_ms=0,
                                   metrics_port=0, metrics_url="")
        state = {"serving": True}
        task = asyncio.create_task(heartbeat(redis, keys, info, lambda: state["serving"],
                                             interval_s=LONG_INTERVAL_S, ttl_s=LONG_INTERVAL_S * 3))
        try:
            assert await _until(lambda: _count(redis, keys.worker("w2"), keys.alive("w2"), want=2), 10)
            assert [w.worker_id for w in await live_workers(redis, keys)] == ["w2"]  # listed in the index
            state["serving"] = False  # a rebalance: no partitions for a while
            assert await _until(lambda: _absent(redis, keys.worker("w2")), 10)
            assert await redis.exists(keys.alive("w2"))
            assert await live_workers(redis, keys) == [] and await redis.zcard(keys.workers_index()) == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert await redis.exists(keys.worker("w2"), keys.alive("w2"), keys.workers_index()) == 0
        await redis.aclose()

    asyncio.run(go())


async def _count(redis, *keys: str, want: int) -> bool:
    return await redis.exists(*keys) == want
