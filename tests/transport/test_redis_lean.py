"""The lean pipelined connection (shared.transport.redis_lean) against a real redis-server: replies in call
order, redis-py's errors, a script the server lost, a restarted server, a cancelled blocking
read, and a password-locked server."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import settings as settings_mod
from shared.transport.redis_conn import make_redis
from shared.transport.redis_lean import LeanRedis
from tests import procs

PASSWORD = "lean-Pa55-0412"


@pytest.fixture
async def pair(redis_url):
    """A redis-py client and a LeanRedis on it, both closed after the test."""
    client = aioredis.from_url(redis_url)
    lean = LeanRedis(client)
    yield client, lean
    await lean.close()
    await client.aclose()


async def test_pipelined_calls_resolve_in_order_with_redis_py_errors(pair):
    _, lean = pair
    k = uuid.uuid4().hex
    got = await asyncio.gather(*(lean.call("INCR", k) for _ in range(50)), lean.call("GET", f"{k}:none"),
                               lean.call("SET", f"{k}:s", b"\x00bytes"), lean.call("GET", f"{k}:s"))
    assert got == [*range(1, 51), None, b"OK", b"\x00bytes"]
    with pytest.raises(ResponseError, match="wrong kind|WRONGTYPE"):
        await lean.call("LPUSH", f"{k}:s", 1)
    assert await lean.call("GET", k) == b"50"  # the error took its own reply only


async def test_evalsha_loads_a_script_the_server_lost(pair):
    client, lean = pair
    script = client.register_script("return {KEYS[1], ARGV[1]}")
    await client.script_flush()
    with pytest.raises(NoScriptError):
        await lean.call("EVALSHA", script.sha, 1, "a", "b")
    assert await lean.evalsha(script, ["a"], [7]) == [b"a", b"7"]
    assert await lean.evalsha(script, ["c"], ["d"]) == [b"c", b"d"]


async def test_a_cancelled_blocking_read_does_not_hold_back_the_next_call(pair):
    _, lean = pair
    k = uuid.uuid4().hex
    read = asyncio.create_task(lean.call("XREAD", "BLOCK", 30_000, "STREAMS", k, "$", blocking_s=30))
    await asyncio.sleep(0.1)  # it blocks in Redis now
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    async with asyncio.timeout(5):  # behind the blocked read it would wait 30 s
        assert await lean.call("PING") == b"PONG"


async def test_a_silent_server_times_out_as_redis_py_would_and_a_blocking_call_gets_its_block(redis_url):
    """The client's socket_timeout bounds each reply (a hung Redis fails the call, the connection
    goes); a call that blocks in Redis gets its block time on top."""
    async def silent(reader, writer):
        await reader.read(1 << 16)  # takes the command, never answers
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hung = aioredis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3)
    live = aioredis.from_url(redis_url, socket_timeout=0.2)
    lean_hung, lean_live = LeanRedis(hung), LeanRedis(live)
    try:
        async with asyncio.timeout(5):
            with pytest.raises(RedisTimeoutError):
                await lean_hung.call("PING")
            assert await lean_live.call("XREAD", "BLOCK", 500, "STREAMS", uuid.uuid4().hex, "$",
                                        blocking_s=0.5) is None  # 0.5 s > its 0.2 s socket_timeout
            assert await lean_live.call("PING") == b"PONG"
    finally:
        for c in (lean_hung, lean_live):
            await c.close()
        server.close()
        await hung.aclose()
        await live.aclose()


async def test_a_restarted_server_fails_the_calls_in_flight_then_reconnects(tmp_path):
    port = procs.free_port()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with procs.redis_server(tmp_path / "a", port=port) as url:
        client = aioredis.from_url(url)
        lean = LeanRedis(client)
        assert await lean.call("PING") == b"PONG"
        blocked = asyncio.create_task(lean.call("BLPOP", "nothing", 30, blocking_s=30))
        await asyncio.sleep(0.1)
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(blocked, 10)
    with pytest.raises(RedisConnectionError):
        await lean.call("PING")  # nobody listens
    with procs.redis_server(tmp_path / "b", port=port):
        try:
            assert await lean.call("PING") == b"PONG"
        finally:
            await lean.close()
            await client.aclose()


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    with procs.redis_server(tmp_path_factory.mktemp("lean-locked"), password=PASSWORD) as url:
        yield url


async def test_the_clients_password_and_db_are_used(locked_redis):
    good = make_redis(settings_mod.from_env({}, redis_url=locked_redis.rsplit("/", 1)[0] + "/3",
                                            redis_password=PASSWORD))
    bad = make_redis(settings_mod.from_env({}, redis_url=locked_redis, redis_password="wrong"))
    lean_good, lean_bad = LeanRedis(good), LeanRedis(bad)
    k = uuid.uuid4().hex
    try:
        assert await lean_good.call("SET", k, "v") == b"OK"
        assert await good.get(k) == b"v"  # the same db (3) as the client's
        assert await lean_good.call("CLIENT", "INFO") and b"db=3" in await lean_good.call("CLIENT", "INFO")
        with pytest.raises(AuthenticationError) as info:
            await lean_bad.call("PING")
        assert "wrong" not in str(info.value) and PASSWORD not in str(info.value)
    finally:
        for c in (lean_good, lean_bad):
            await c.close()
        await good.aclose()
        await bad.aclose()
