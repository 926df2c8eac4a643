"""The token log's compare-and-append against a real Redis: two decodes of one request (a
redelivery racing a live worker, an attempt re-driven after a broker restart) never both write a
position, and a flushed counter does not wedge the writer that goes on."""

from __future__ import annotations

import asyncio

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


async def test_a_log_rewritten_after_a_flush_reaches_the_reader_once(redis_url):
    """Prefill wrote delta 0 and the gateway read it; Redis is flushed before decode reads the
    log, so decode writes the request from delta 0 again. The reader yields each position once."""
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys("toklog")
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    try:
        assert await streams.append_delta("r3", _delta(0), position=0)
        deadline_s = asyncio.get_running_loop().time() + 10
        follow = streams.follow("r3", deadline_s=deadline_s, block_ms=200)
        first = await anext(follow)
        await redis.delete(keys.token_seq("r3"), keys.token_stream("r3"))  # what FLUSHALL does to it
        await asyncio.sleep(0.01)  # decode comes later: its entry ids are past the reader's
        for i in range(3):
            assert await streams.append_delta("r3", _delta(i), position=i)
        await streams.append("r3", protocol.Finish(reason="length", usage=protocol.Usage(
            prompt_tokens=1, completion_tokens=3)))
        rest = [e async for e in follow]
        deltas = [e for e in [first, *rest] if isinstance(e, protocol.TokenDelta)]
        assert [e.text for e in deltas] == ["t0", "t1", "t2"]
        assert isinstance(rest[-1], protocol.Finish)
    finally:
        await redis.aclose()


async def test_appends_of_one_loop_turn_share_a_round_trip(redis_url):
    """A batched decode step's sequences append together: one pipeline, each writer its own
    answer, a racing second writer of a position still refused."""
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    executed = []
    real_pipeline = redis.pipeline

    def counting_pipeline(*a, **kw):
        pipe = real_pipeline(*a, **kw)
        real_execute = pipe.execute

        async def execute(*ea, **ekw):
            executed.append(len(pipe.command_stack))
            return await real_execute(*ea, **ekw)

        pipe.execute = execute
        return pipe

    redis.pipeline = counting_pipeline
    try:
        got = await asyncio.gather(*(streams.append_delta(f"b{i}", _delta(0), position=0) for i in range(8)),
                                   streams.append_delta("b0", _delta(0), position=0))
        assert got == [True] * 8 + [False]
        assert executed == [9]
        for i in range(8):
            assert [e.seq for e in await streams.history(f"b{i}")] == [0]
    finally:
        redis.pipeline = real_pipeline
        await redis.aclose()


async def test_appends_go_on_after_redis_forgets_its_scripts(redis_url):
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    try:
        assert await streams.append_delta("s1", _delta(0), position=0)
        await redis.script_flush()  # what a Redis restart does to the cached script
        assert await streams.append_delta("s1", _delta(1), position=1)
        assert not await streams.append_delta("s1", _delta(1), position=1)
        assert [e.seq for e in await streams.history("s1")] == [0, 1]
    finally:
        await redis.aclose()
