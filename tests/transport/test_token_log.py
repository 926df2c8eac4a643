"""The token log's compare-and-append against a real Redis: two decodes of one request (a
redelivery racing a live worker, an attempt re-driven after a broker restart) never both write a
position, and a flushed counter does not wedge the writer that goes on."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys
from shared.streams import TokenStreams


def _delta(i: int) -> protocol.TokenDelta:
    return protocol.TokenDelta(seq=i, token_ids=(100 + i,), text=f"t{i}")


async def test_only_the_next_position_is_written(redis_url):
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    try:
        assert await streams.append_delta("r1", _delta(0), position=0)
        assert await streams.append_delta("r1", _delta(1), position=1)
        assert not await streams.append_delta("r1", _delta(1), position=1)  # the second writer of 1
        assert not await streams.append_delta("r1", _delta(0), position=0)  # a writer behind the log
        assert not await streams.append_delta("r1", _delta(5), position=5)  # a gap is refused too
        assert await streams.append_delta("r1", _delta(2), position=2)
        history = await streams.history("r1")
        assert [e.seq for e in history] == [0, 1, 2]
    finally:
        await redis.aclose()


async def test_a_flushed_counter_accepts_the_writer_that_goes_on(redis_url):
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys("toklog")
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    try:
        for i in range(3):
            assert await streams.append_delta("r2", _delta(i), position=i)
        await redis.delete(keys.token_seq("r2"), keys.token_stream("r2"))  # what FLUSHALL does to it
        assert await streams.append_delta("r2", _delta(3), position=3)
        assert not await streams.append_delta("r2", _delta(3), position=3)
        assert await streams.append_delta("r2", _delta(4), position=4)
        assert [e.seq for e in await streams.history("r2")] == [3, 4]
    finally:
        await redis.aclose()
