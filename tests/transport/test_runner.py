"""The generic stage runner against the real broker and Redis: produce-then-commit,
redelivery of uncommitted work, retries, dead letters, deadlines, and the token stream."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer

from shared import protocol
from shared.keys import TOPIC_DEAD_LETTER, RedisKeys
from shared.settings import Settings
from shared.stage import Context, Outcome, Produce, RequestFailed
from shared.transport.bus import ensure_topics, make_producer
from shared.transport.consume import OffsetTracker
from shared.transport.runner import StageRunner
from shared.transport.streams import TokenStreams


def _meta(rid: str, *, deadline_ms: int = 60_000) -> protocol.RequestMeta:
    now = int(time.time() * 1000)
    return protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now, deadline_unix_ms=now + deadline_ms,
                                prompt_token_ids=(1, 2, 3))


@pytest.fixture
async def env(kafka_bootstrap, redis_url):
    tag = uuid.uuid4().hex[:8]
    settings = Settings(kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, redis_prefix=f"t{tag}",
                        topic_partitions=2, fetch_max_wait_ms=10, max_attempts=3, drain_timeout_ms=300,
                        kafka_session_timeout_ms=2_000)  # tansu holds a first join for half of it
    topic_in, topic_out = f"t.in.{tag}", f"t.out.{tag}"
    await ensure_topics(settings, (topic_in, topic_out, TOPIC_DEAD_LETTER))
    producer = make_producer(settings)
    await producer.start()
    redis = aioredis.from_url(redis_url)
    streams = TokenStreams(redis, RedisKeys(settings.redis_prefix), maxlen=1000, ttl_s=60)
    yield {"settings": settings, "in": topic_in, "out": topic_out, "producer": producer, "streams": streams,
           "redis": redis, "tag": tag}
    await producer.stop()
    await redis.aclose()


class Echo:
    """PrefillRequest → the same request on the output topic; scripted failures."""

    def __init__(self, out_topic: str, *, fail_times: int = 0, block: asyncio.Event | None = None,
                 terminal: bool = False) -> None:
        self.out = out_topic
        self.fail_times = fail_times
        self.block = block
        self.terminal = terminal
        self.calls = 0

    async def handle(self, msg, ctx):
        self.calls += 1
        if self.block is not None:
            await self.block.wait()
        if self.terminal:
            raise RequestFailed.bad_request("no thanks", param="x")
        if self.calls <= self.fail_times:
            raise RuntimeError(f"scripted failure {self.calls}")
        return Outcome([Produce(self.out, msg.meta.request_id, msg)])


def _runner(env, handler, stage: str) -> StageRunner:
    ctx = Context(stage=stage, worker_id="w", events=env["streams"])
    return StageRunner(stage=stage, topic=env["in"], union=protocol.PrefillRequest, handler=handler, ctx=ctx,
                       producer=env["producer"], settings=env["settings"])


async def _send(env, msg) -> None:
    await env["producer"].send_and_wait(env["in"], protocol.encode(msg), key=msg.meta.request_id.encode())


async def _drain_topic(bootstrap: str, topic: str, want: int, timeout_s: float = 20) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                fetch_max_wait_ms=20)
    await consumer.start()
    out: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(r.value for r in records)
    finally:
        await consumer.stop()
    return out


async def _until(pred, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _events(env, rid: str) -> list[protocol.StreamEvent]:
    """Every event of ``rid`` up to its terminal one."""
    loop = asyncio.get_running_loop()
    return [e async for e in env["streams"].follow(rid, deadline_s=loop.time() + 30)]


async def _start(runner: StageRunner) -> asyncio.Task:
    """Run and wait until the group gave it partitions (a join takes seconds on tansu)."""
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner.assigned.wait(), 30)
    return task


async def _nothing_left(env, stage: str) -> None:
    """A second runner of the stage's group finds no record: everything was committed."""
    again = Echo(env["out"])
    runner = _runner(env, again, stage)
    task = await _start(runner)
    await asyncio.sleep(1.0)
    runner.stop()
    await task
    assert again.calls == 0


async def test_outputs_produced_and_offsets_committed(env):
    runner = _runner(env, Echo(env["out"]), f"ok-{env['tag']}")
    task = await _start(runner)
    for i in range(5):
        await _send(env, protocol.PrefillRequest(meta=_meta(f"r{i}")))
    out = await _drain_topic(env["settings"].kafka_bootstrap, env["out"], 5)
    assert sorted(protocol.decoder_for(protocol.PrefillRequest).decode(v).meta.request_id for v in out) == \
        [f"r{i}" for i in range(5)]
    await _until(lambda: runner.processed == 5)
    runner.stop()
    await task
    await _nothing_left(env, f"ok-{env['tag']}")


async def test_commits_are_coalesced_to_the_interval(env):
    """Finished records are committed at most once per ``commit_interval_ms`` (each commit costs a
    Redis read and a broker round trip); stopping still commits what is done."""
    env = {**env, "settings": env["settings"].with_overrides(commit_interval_ms=1_000)}
    runner = _runner(env, Echo(env["out"]), f"co-{env['tag']}")
    consumer, commits = runner._loop._consumer, []
    commit = consumer.commit

    async def counted(offsets=None):
        commits.append(time.monotonic())
        return await commit(offsets)

    consumer.commit = counted
    task = await _start(runner)
    t0 = time.monotonic()
    for i in range(20):  # spread out: each would get a commit of its own without coalescing
        await _send(env, protocol.PrefillRequest(meta=_meta(f"c{i}")))
        await asyncio.sleep(0.02)
    await _until(lambda: runner.processed == 20)
    elapsed_s = time.monotonic() - t0
    assert len(commits) <= elapsed_s / 1.0 + 2, (len(commits), elapsed_s)
    runner.stop()
    await task
    await _nothing_left(env, f"co-{env['tag']}")  # the stop committed the rest


async def test_uncommitted_work_is_redelivered_after_a_stop(env):
    stage = f"redeliver-{env['tag']}"
    stuck = Echo(env["out"], block=asyncio.Event())  # never finishes: drain times out, work cancelled
    runner = _runner(env, stuck, stage)
    task = await _start(runner)
    await _send(env, protocol.PrefillRequest(meta=_meta("again")))
    await _until(lambda: stuck.calls == 1)
    runner.stop()
    await task
    fresh = Echo(env["out"])
    runner2 = _runner(env, fresh, stage)
    task2 = await _start(runner2)
    await _until(lambda: runner2.processed == 1, timeout_s=30)
    runner2.stop()
    await task2
    assert fresh.calls == 1


async def test_transient_failures_are_retried(env):
    handler = Echo(env["out"], fail_times=2)
    runner = _runner(env, handler, f"retry-{env['tag']}")
    task = await _start(runner)
    await _send(env, protocol.PrefillRequest(meta=_meta("flaky")))
    assert len(await _drain_topic(env["settings"].kafka_bootstrap, env["out"], 1)) == 1
    runner.stop()
    await task
    assert handler.calls == 3


async def test_poison_goes_to_dead_letter_and_client_gets_an_error(env):
    runner = _runner(env, Echo(env["out"], fail_times=99), f"poison-{env['tag']}")
    task = await _start(runner)
    await _send(env, protocol.PrefillRequest(meta=_meta(f"poison-{env['tag']}")))
    events = await _events(env, f"poison-{env['tag']}")
    runner.stop()
    await task
    assert isinstance(events[-1], protocol.ErrorEvent) and events[-1].status == 500
    letters = [protocol.decoder_for(protocol.DeadLetter).decode(v)
               for v in await _drain_topic(env["settings"].kafka_bootstrap, TOPIC_DEAD_LETTER, 50, timeout_s=3)]
    mine = [d for d in letters if d.topic == env["in"]]
    assert mine and "scripted failure 3" in mine[0].error and mine[0].attempts == 3


async def test_expired_deadline_is_a_504_without_work(env):
    handler = Echo(env["out"])
    runner = _runner(env, handler, f"late-{env['tag']}")
    task = await _start(runner)
    await _send(env, protocol.PrefillRequest(meta=_meta("late", deadline_ms=-1)))
    events = await _events(env, "late")
    runner.stop()
    await task
    assert events[-1].status == 504 and events[-1].code == "deadline_exceeded"
    assert handler.calls == 0


async def test_request_failure_is_terminal_not_retried(env):
    handler = Echo(env["out"], terminal=True)
    runner = _runner(env, handler, f"terminal-{env['tag']}")
    task = await _start(runner)
    await _send(env, protocol.PrefillRequest(meta=_meta("nope")))
    events = await _events(env, "nope")
    runner.stop()
    await task
    assert (events[-1].status, events[-1].param) == (400, "x")
    assert handler.calls == 1


async def test_undecodable_record_is_dead_lettered_and_the_runner_goes_on(env):
    handler = Echo(env["out"])
    runner = _runner(env, handler, f"garbage-{env['tag']}")
    task = await _start(runner)
    await env["producer"].send_and_wait(env["in"], b"\x00garbage", key=b"g")
    await _send(env, protocol.PrefillRequest(meta=_meta("after-garbage")))
    assert len(await _drain_topic(env["settings"].kafka_bootstrap, env["out"], 1)) == 1
    runner.stop()
    await task


async def test_token_stream_follow_is_ordered_and_bounded_in_time(env):
    streams = env["streams"]
    rid = f"s-{env['tag']}"
    for i in range(3):
        await streams.append(rid, protocol.TokenDelta(seq=i, token_ids=(i,), text=str(i)))
    await streams.append(rid, protocol.Finish(reason="stop", usage=protocol.Usage(1, 3)))
    loop = asyncio.get_running_loop()
    got = [e async for e in streams.follow(rid, deadline_s=loop.time() + 5)]
    assert [e.text for e in got[:3]] == ["0", "1", "2"] and isinstance(got[-1], protocol.Finish)
    assert 0 < await env["redis"].ttl(RedisKeys(env["settings"].redis_prefix).token_stream(rid)) <= 60
    with pytest.raises(TimeoutError):
        async for _ in streams.follow("nobody", deadline_s=loop.time() + 0.3):
            pass


def test_offset_tracker_commits_only_below_the_oldest_in_flight():
    t = OffsetTracker()
    for off in (5, 6, 7):
        t.begin(off)
    t.done(7)
    assert t.committable() == 5  # 5 and 6 still running: nothing at or past 5 is safe
    t.done(5)
    assert t.committable() == 6
    t.mark_committed(6)
    t.done(6)
    assert t.committable() == 8
    t.mark_committed(8)
    assert t.committable() is None

