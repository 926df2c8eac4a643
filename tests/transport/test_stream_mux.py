"""The shared blocking read of token streams against a real Redis (shared.transport.stream_mux): a
follower that joins while the read blocks."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.transport.stream_mux import StreamMux


async def _first_entry(sub, timeout_s: float = 5.0):
    async with asyncio.timeout(timeout_s):
        while not sub.entries:
            sub.event.clear()
            await sub.event.wait()
    return sub.entries[0]


async def test_a_follower_joining_while_reads_return_needs_no_wake(redis_url):
    """Another stream's entry ends the blocking read; the next read includes the new follower,
    so no wake is sent (the wake would come only after 30 s here)."""
    redis = aioredis.from_url(redis_url)
    p = uuid.uuid4().hex
    mux = StreamMux(redis, f"{p}:wake", ttl_s=60, block_ms=30_000, wake_delay_s=30.0)
    try:
        a = await mux.subscribe(f"{p}:a")
        await asyncio.sleep(0.1)  # the read now blocks on a
        b = await mux.subscribe(f"{p}:b")
        await redis.xadd(f"{p}:a", {b"e": b"1"})
        await _first_entry(a)
        await redis.xadd(f"{p}:b", {b"e": b"2"})
        _eid, fields = await _first_entry(b)
        assert fields == {b"e": b"2"} and mux.wakes == 0
    finally:
        await mux.close()
        await redis.aclose()


async def test_a_follower_joining_a_quiet_read_wakes_it_after_the_delay(redis_url):
    redis = aioredis.from_url(redis_url)
    p = uuid.uuid4().hex
    mux = StreamMux(redis, f"{p}:wake", ttl_s=60, block_ms=30_000, wake_delay_s=0.05)
    try:
        await mux.subscribe(f"{p}:a")
        await asyncio.sleep(0.1)  # the read now blocks on a, and nothing comes there
        b = await mux.subscribe(f"{p}:b")
        await redis.xadd(f"{p}:b", {b"e": b"2"})
        _eid, fields = await _first_entry(b)  # far inside the 30 s block
        assert fields == {b"e": b"2"} and mux.wakes == 1
    finally:
        await mux.close()
        await redis.aclose()


async def test_close_ends_a_read_that_blocks_for_followers_still_subscribed(redis_url):
    """A cancel can be lost inside redis-py's blocking read (Python 3.11's ``wait_for``): the
    reader went on reading for its followers, so ``close`` hung (for ever with a 1 s block, as
    each read was sent again). Now it ends the read with a wake."""
    redis = aioredis.from_url(redis_url)
    p = uuid.uuid4().hex
    mux = StreamMux(redis, f"{p}:wake", ttl_s=60, block_ms=1_000, wake_delay_s=30.0)
    try:
        a = await mux.subscribe(f"{p}:a")
        await asyncio.sleep(0.1)
        b = await mux.subscribe(f"{p}:b")
        await redis.xadd(f"{p}:a", {b"e": b"1"})
        await _first_entry(a)
        await redis.xadd(f"{p}:b", {b"e": b"2"})
        await _first_entry(b)  # the read was sent again, and blocks
        await asyncio.wait_for(mux.close(), 3.0)
    finally:
        await redis.aclose()
