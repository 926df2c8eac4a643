"""The process's Redis client (``shared.transport.redis_conn.make_redis``) against a real Redis: its
connection pool is bounded by the gateway's admission bound plus headroom, and a burst past the
bound waits for a connection instead of failing (redis-py's default pool raises past 100, which
40 concurrent streams and their doorbell rings reached)."""

from __future__ import annotations

import asyncio

from redis import exceptions as redis_exceptions

from shared.settings import Settings
from shared.transport import redis_conn


async def test_pool_is_sized_from_the_admission_bound(redis_url):
    redis = redis_conn.make_redis(Settings(redis_url=redis_url, max_inflight_requests=300))
    try:
        assert redis.connection_pool.max_connections == 300 + redis_conn._POOL_HEADROOM
        assert await redis.ping()
    finally:
        await redis.aclose()


async def test_blocking_reads_past_the_bound_wait_for_a_connection(redis_url, monkeypatch):
    monkeypatch.setattr(redis_conn, "_POOL_HEADROOM", 0)
    redis = redis_conn.make_redis(Settings(redis_url=redis_url, max_inflight_requests=3))
    try:
        # six followers, three connections: each blocking XREAD holds one for 200 ms
        pool = redis.connection_pool
        seen = []

        async def watch():
            while True:
                seen.append(len(pool._in_use_connections))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        replies = await asyncio.gather(*(redis.xread({f"pool-test-{i}": "$"}, block=200) for i in range(6)))
        watcher.cancel()
        assert all(not r for r in replies)  # every read ran (nothing was written): none failed
        assert max(seen) == 3
    finally:
        await redis.aclose()


async def test_many_short_commands_share_the_bound_and_none_is_lost(redis_url, monkeypatch):
    """A free connection is taken without the blocking pool's condition; once none is free,
    callers queue and every release wakes one (100 commands on 3 connections)."""
    monkeypatch.setattr(redis_conn, "_POOL_HEADROOM", 0)
    redis = redis_conn.make_redis(Settings(redis_url=redis_url, max_inflight_requests=3))
    try:
        pool = redis.connection_pool
        await redis.delete("pool-test-count")
        peak = 0

        async def one():
            nonlocal peak
            await redis.incr("pool-test-count")
            peak = max(peak, len(pool._in_use_connections))

        await asyncio.gather(*(one() for _ in range(100)))
        assert int(await redis.get("pool-test-count")) == 100
        assert peak <= 3 and len(pool._in_use_connections) == 0
        assert pool._waiting == 0
    finally:
        await redis.delete("pool-test-count")
        await redis.aclose()


async def test_commands_the_socket_takes_at_once_skip_the_send_timeout_and_big_ones_still_drain(redis_url):
    """Sends go straight to the socket (``_DirectSend``, which relies on redis-py's ``_writer``);
    a value larger than the socket's buffer takes the drained, timed path and arrives whole."""
    redis = redis_conn.make_redis(Settings(redis_url=redis_url))
    try:
        assert await redis.ping()
        conn = await redis.connection_pool.get_connection()
        try:
            assert isinstance(conn, redis_conn._DirectSend) and conn._writer is not None
            assert conn.socket_timeout  # reads (and sends that wait) stay bounded
        finally:
            await redis.connection_pool.release(conn)
        big = bytes(range(256)) * (64 * 1024)  # 16 MiB
        await redis.set("pool-test-big", big)
        assert await redis.get("pool-test-big") == big
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(200):
                pipe.set(f"pool-test-{i}", i)
            assert all(await pipe.execute())
        assert await redis.get("pool-test-199") == b"199"
    finally:
        await redis.delete("pool-test-big", *(f"pool-test-{i}" for i in range(200)))
        await redis.aclose()


async def test_a_connection_the_server_closed_is_replaced(redis_url):
    redis = redis_conn.make_redis(Settings(redis_url=redis_url))
    other = redis_conn.make_redis(Settings(redis_url=redis_url))
    try:
        client_id = await redis.client_id()
        await other.client_kill_filter(_id=client_id)
        try:  # redis-py may notice the closed socket on this command (as with its own pools)...
            await redis.ping()
        except redis_exceptions.ConnectionError:
            pass
        assert await redis.client_id() != client_id  # ...and sends the next on a new connection
    finally:
        await redis.aclose()
        await other.aclose()
