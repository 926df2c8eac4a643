"""The token log against a real Redis: two decodes of one request (a redelivery racing a live
worker, an attempt re-driven after a broker restart) never both write a position, a flushed
counter does not wedge the writer that goes on, a log flushed after its writer finished is
written back by its follower and the request run again, and a process's followers share one
reader."""

from __future__ import annotations

import asyncio
import sys

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys
from shared.stage import LogLost
from shared.transport.ledger import WriteGuard
from shared.transport.redis_lean import LeanRedis
from shared.transport.streams import TokenStreams
from tests.roundtrips import count_round_trips


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


async def test_a_flushed_log_makes_the_writer_start_it_again(redis_url):
    """Past position 0 a missing counter means the log went (FLUSHALL) with deltas no reader may
    have read: the writer is told (LogLost), and position 0 is accepted again."""
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys("toklog")
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    try:
        for i in range(3):
            assert await streams.append_delta("r2", _delta(i), position=i)
        await redis.delete(keys.token_seq("r2"), keys.token_stream("r2"))  # what FLUSHALL does to it
        with pytest.raises(LogLost):
            await streams.append_delta("r2", _delta(3), position=3)
        for i in range(4):
            assert await streams.append_delta("r2", _delta(i), position=i)
        assert not await streams.append_delta("r2", _delta(3), position=3)
        assert [e.seq for e in await streams.history("r2")] == [0, 1, 2, 3]
    finally:
        await redis.aclose()


async def test_a_log_lost_after_its_writer_finished_is_written_back_and_rerun(redis_url, monkeypatch):
    """Decode wrote the whole log and finished; the reader had read deltas 0-1 when Redis was
    flushed, so the rest is gone and nobody writes it again (seen in the Redis-flush e2e test:
    a request waited out its deadline). The follower notices the missing log, writes back what
    it read, and asks for the request to run again; the new run resumes after those deltas."""
    monkeypatch.setattr("shared.transport.streams.LOST_CHECK_S", 0.2)
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys("toklog")
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    reruns = []
    try:
        for i in range(2):
            assert await streams.append_delta("r5", _delta(i), position=i)
        follow = streams.follow("r5", deadline_s=asyncio.get_running_loop().time() + 10,
                                on_lost=lambda: asyncio.sleep(0, reruns.append("r5")))
        got = [await anext(follow), await anext(follow)]
        await redis.delete(keys.token_seq("r5"), keys.token_stream("r5"))  # what FLUSHALL does to it
        rest = asyncio.ensure_future(anext(follow))
        for _ in range(50):
            await asyncio.sleep(0.05)
            if reruns:
                break
        assert reruns == ["r5"]
        assert [e.seq for e in await streams.history("r5")] == [0, 1]  # written back: a rerun resumes after them
        assert not await streams.append_delta("r5", _delta(1), position=1)  # the rerun's decode skips what is there
        assert await streams.append_delta("r5", _delta(2), position=2)
        await streams.append("r5", protocol.Finish(reason="length", usage=protocol.Usage(
            prompt_tokens=1, completion_tokens=3)))
        got.append(await rest)
        got += [e async for e in follow]
        assert [getattr(e, "seq", "end") for e in got] == [0, 1, 2, "end"]
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
        follow = streams.follow("r3", deadline_s=deadline_s)
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


async def test_appends_of_one_loop_turn_share_a_round_trip(redis_url, monkeypatch):
    """A batched decode step's sequences append together: one script call, each writer its own
    answer, a racing second writer of a position still refused."""
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    executed = count_round_trips(monkeypatch, redis)
    try:
        got = await asyncio.gather(*(streams.append_delta(f"b{i}", _delta(0), position=0) for i in range(8)),
                                   streams.append_delta("b0", _delta(0), position=0))
        assert got == [True] * 8 + [False]
        assert executed == ["EVALSHA"]
        for i in range(8):
            assert [e.seq for e in await streams.history(f"b{i}")] == [0]
        # one call, three outcomes: appended, another writer's position, a log that is gone
        executed.clear()
        mixed = await asyncio.gather(streams.append_delta("b1", _delta(1), position=1),
                                     streams.append_delta("b2", _delta(5), position=5),
                                     streams.append_delta("never", _delta(3), position=3), return_exceptions=True)
        assert mixed[:2] == [True, False] and isinstance(mixed[2], LogLost)
        assert executed == ["EVALSHA"]
        assert [e.seq for e in await streams.history("b1")] == [0, 1]
        assert [e.seq for e in await streams.history("b2")] == [0]
    finally:
        await redis.aclose()


async def test_a_guarded_append_is_written_only_if_redis_shows_its_guard(redis_url, monkeypatch):
    """``append_delta_if``: written only while the claim key holds the owner and the acked key the
    record's partition, checked in the same script call as the append (and as unguarded appends
    of the same loop turn); None, with nothing written, when either is not so."""
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys("toklog")
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    claim, acked = keys.lease("g1", "prefill#0"), keys.acked("mm.prefill", "g1", 0)
    guard = WriteGuard(claim, "worker-a", acked, 2)
    executed = count_round_trips(monkeypatch, redis)
    try:
        assert await streams.append_delta_if("g1", _delta(0), 0, guard) is None  # neither there
        await redis.set(claim, "worker-a")
        assert await streams.append_delta_if("g1", _delta(0), 0, guard) is None  # not acked yet
        await redis.set(acked, "1")
        assert await streams.append_delta_if("g1", _delta(0), 0, guard) is None  # another partition's record
        await redis.set(acked, "2")
        await redis.set(claim, "worker-b")
        assert await streams.append_delta_if("g1", _delta(0), 0, guard) is None  # another worker's claim
        assert await streams.history("g1") == []
        await redis.set(claim, "worker-a")
        executed.clear()
        got = await asyncio.gather(streams.append_delta_if("g1", _delta(0), 0, guard),
                                   streams.append_delta("g2", _delta(0), position=0),
                                   streams.append_delta_if("g3", _delta(0), 0, guard._replace(owner="worker-b")))
        assert got == [True, True, None] and executed == ["EVALSHA"]
        assert await streams.append_delta_if("g1", _delta(0), 0, guard) is False  # met, but position 0 is taken
        assert [e.seq for e in await streams.history("g1")] == [0] and await streams.history("g3") == []
    finally:
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


class _Stepper:
    """A batched decode step's tokens: every ``step_s`` one token for each sequence, as the
    decode core hands them to the worker."""

    def __init__(self, ids: list[int], sequences: int, step_s: float = 0.004) -> None:
        self.ids, self.step_s = ids, step_s
        self.queues = [asyncio.Queue() for _ in range(sequences)]

    async def run(self) -> None:
        for t in self.ids:
            for q in self.queues:
                q.put_nowait(t)
            await asyncio.sleep(self.step_s)

    async def tokens(self, i: int):
        for _ in self.ids:
            yield await self.queues[i].get()


async def test_decodes_queue_their_appends_and_a_step_shares_one_call(redis_url, monkeypatch, model_dir):
    """Three decodes stepped together through ``stream_completion`` on Redis's sink: each step's
    deltas go in one script call, the writers await no delta's append (only the Finish's), and
    every log is whole and in order. A second decode of one request, behind the first, stops
    without writing."""
    from transformers import AutoTokenizer

    from shared.engines.token_stream import stream_completion

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(" the sea is blue and calm today", add_special_tokens=False)
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    awaited = []
    append_delta = streams.append_delta

    async def counted(request_id, delta, position):
        awaited.append(type(delta).__name__)
        return await append_delta(request_id, delta, position)

    monkeypatch.setattr(streams, "append_delta", counted)
    stepper = _Stepper(ids, 3)

    def meta(rid):
        return protocol.RequestMeta(request_id=rid, model="m", deadline_unix_ms=1, created_unix_ms=0,
                                    prompt_token_ids=(1,), sampling=protocol.Sampling(max_tokens=len(ids)))

    async def decode(i):
        await stream_completion(streams, meta(f"q{i}"), stepper.tokens(i), tokenizer=tok,
                                eos_token_ids=frozenset({2}), prompt_len=1, lookahead_tokens=0)

    executed = count_round_trips(monkeypatch, redis)
    try:
        await asyncio.gather(stepper.run(), *(decode(i) for i in range(3)))
        assert awaited == ["Finish"] * 3
        assert executed.count("EVALSHA") <= len(ids) + 1  # a call per step (+ the Finishes')
        for i in range(3):
            log = await streams.history(f"q{i}")
            assert [e.seq for e in log[:-1]] == list(range(len(ids))) and isinstance(log[-1], protocol.Finish)
            assert "".join(e.text for e in log[:-1]) == tok.decode(ids)
        # a redelivered decode of q0 that read delta 0 only: every position it would write is taken
        late = _Stepper(ids[1:], 1, step_s=0)
        before = await streams.history("q0")
        await asyncio.gather(late.run(), stream_completion(
            streams, meta("q0"), late.tokens(0), tokenizer=tok, eos_token_ids=frozenset({2}), prompt_len=1,
            first_token=ids[0], skip_deltas=1, lookahead_tokens=0))
        assert await streams.history("q0") == before
    finally:
        await redis.aclose()


def _finish(n: int) -> protocol.Finish:
    return protocol.Finish(reason="length", usage=protocol.Usage(prompt_tokens=1, completion_tokens=n))


async def test_followers_share_one_blocking_read(redis_url, monkeypatch):
    """Eight requests streaming at once: each follower gets its own events in order, and the
    process reads them with far fewer XREADs than one per follower per step."""
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    calls = []  # per XREAD: the streams it reads
    real_call = LeanRedis.call

    async def counting_call(self, *a, **kw):
        if a[0] == "XREAD":
            calls.append((len(a) - a.index("STREAMS") - 1) // 2)
        return await real_call(self, *a, **kw)

    monkeypatch.setattr(LeanRedis, "call", counting_call)
    n, steps = 8, 6
    try:
        deadline_s = asyncio.get_running_loop().time() + 20

        async def collect(i: int) -> list:
            return [e async for e in streams.follow(f"m{i}", deadline_s=deadline_s)]

        readers = [asyncio.create_task(collect(i)) for i in range(n)]
        await asyncio.sleep(0.1)
        for step in range(steps):  # a batched decode step: every sequence's token in one pipeline
            assert all(await asyncio.gather(*(streams.append_delta(f"m{i}", _delta(step), position=step)
                                              for i in range(n))))
            await asyncio.sleep(0.02)
        await asyncio.gather(*(streams.append(f"m{i}", _finish(steps)) for i in range(n)))
        got = await asyncio.wait_for(asyncio.gather(*readers), 20)
        for events in got:
            assert [e.seq for e in events[:-1]] == list(range(steps)) and isinstance(events[-1], protocol.Finish)
        assert max(calls) == n + 1  # every open stream and the wake stream in one read
        assert len(calls) < n * steps  # one XREAD per follower per step was n * steps
    finally:
        await streams.close()
        await redis.aclose()


async def test_a_follower_joining_a_blocked_read_is_served_at_once(redis_url):
    """The reader blocks up to its block time on the streams it has; a new follower wakes it, so
    its first event does not wait for that block to end."""
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60, read_block_ms=30_000)
    loop = asyncio.get_running_loop()
    try:
        idle = streams.follow("w-idle", deadline_s=loop.time() + 60)
        idle_task = asyncio.create_task(anext(idle))
        await asyncio.sleep(0.2)  # the reader now blocks on w-idle for up to 30 s
        assert await streams.append_delta("w-new", _delta(0), position=0)
        fresh = streams.follow("w-new", deadline_s=loop.time() + 60)
        first = await asyncio.wait_for(anext(fresh), 10)  # far inside the 30 s block
        assert first.seq == 0
        await fresh.aclose()
        idle_task.cancel()
        await asyncio.gather(idle_task, return_exceptions=True)
        await idle.aclose()
        with_deadline = streams.follow("w-none", deadline_s=loop.time() + 0.3)
        try:
            await anext(with_deadline)
            raise AssertionError("a stream with no events must time out")
        except TimeoutError:
            pass
    finally:
        await streams.close()
        await redis.aclose()


async def test_a_follower_arms_one_timer_not_one_per_event(redis_url):
    """The follower's deadline and lost-log check share one timer, re-armed only once it fired:
    a timeout around every wait made and cancelled a timer per token."""
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys("toklog"), maxlen=1000, ttl_s=60)
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    real_call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kw):
        # a timer the follower arms itself, directly or through asyncio.timeout (not one of the
        # Redis client's, which it calls, nor one of this test's)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.endswith("asyncio/timeouts.py"):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_name == "follow" and frame.f_code.co_filename.endswith("streams.py"):
            armed.append(when)
        return real_call_at(when, callback, *args, **kw)

    n = 40
    try:
        loop.call_at = counting_call_at
        follower = streams.follow("one-timer", deadline_s=loop.time() + 30)
        got = []
        for i in range(n + 1):  # one event at a time, each written while the follower waits for it
            waiting = asyncio.create_task(anext(follower))
            await asyncio.sleep(0.01 if i else 0.05)
            assert not waiting.done()
            if i < n:
                assert await streams.append_delta("one-timer", _delta(i), position=i)
            else:
                await streams.append("one-timer", _finish(n))
            got.append(await asyncio.wait_for(waiting, 10))
        assert [e.seq for e in got[:-1]] == list(range(n)) and isinstance(got[-1], protocol.Finish)
        assert 1 <= len(armed) <= 2, len(armed)  # a timeout around each wait armed n + 1
    finally:
        loop.call_at = real_call_at
        await streams.close()
        await redis.aclose()
