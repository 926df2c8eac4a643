"""The doorbell against the real embedded broker and Redis: an idle consumer (no broker-side
wait) sleeps between empty fetches until a ring, fetches at once on one, and still picks a
record up within the idle interval when no ring comes (a lost ring costs a delay, never a
record). Also pins the aiokafka internal the doorbell wraps."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared import protocol
from shared.keys import RedisKeys
from shared.settings import Settings
from shared.stage import Produce
from shared.transport.bus import ensure_topics, make_producer, produce_all
from shared.transport.doorbell import ACKED_TTL_MS, RING_CLIENT_NAME, Doorbell, _Bell
from tests.waits import until


@pytest.fixture
async def bell_env(kafka_bootstrap, redis_url):
    tag = uuid.uuid4().hex[:8]
    settings = Settings(kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, redis_prefix=f"t{tag}",
                        topic_partitions=1)
    topic = f"t.bell.{tag}"
    await ensure_topics(settings, (topic,))
    producer = make_producer(settings)
    await producer.start()
    redis = aioredis.from_url(redis_url)
    yield settings, topic, producer, redis
    await producer.stop()
    await redis.aclose()


async def _consume(settings, topic, bell, got: list, fetches: list):
    # no group (a join takes seconds on tansu); 1 ms broker wait as the runner uses
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=1)
    consumer.assign([TopicPartition(topic, 0)])
    await consumer.start()
    inner = consumer._fetcher._proc_fetch_request  # the method the doorbell wraps must exist

    async def counting(*args):
        entry = [time.monotonic(), None, None]  # began, came back, what aiokafka's method returned
        fetches.append(entry)
        entry[2] = await inner(*args)
        entry[1] = time.monotonic()
        return entry[2]

    consumer._fetcher._proc_fetch_request = counting
    bell.attach(consumer, topic)
    try:
        while True:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                got.extend((r.value, time.monotonic()) for r in records)
    finally:
        await consumer.stop()


async def _warm_up(producer, topic: str, pub: Doorbell, got: list, task: asyncio.Task,
                   sub: Doorbell | None = None) -> None:
    """Produce a first record and ring until the consumer has it (the consumer's start takes
    seconds on tansu) and, given ``sub``, until its subscription has heard a ring: the consumer's
    first fetch can get the record before the subscriber's SUBSCRIBE is in, and a ring sent
    before then reaches no one (one CI run lost the test's only ring that way, on a loaded machine)."""
    await producer.send_and_wait(topic, b"warm")
    deadline = time.monotonic() + 30
    while not got or (sub is not None and not sub.rings_heard):
        assert time.monotonic() < deadline, f"after 30 s of rings: {len(got)} records, {sub and sub.rings_heard} heard"
        if task.done():
            task.result()
        pub.ring(topic)
        await asyncio.sleep(0.1)


def _since_ring(rung_at: float, sub: Doorbell, heard: int, fetches: list, task: asyncio.Task) -> str:
    """What happened after a ring whose record never came: was it heard, which fetches went out
    and what they brought (aiokafka's method returns True when it buffered records), and whether
    the consumer died."""
    ms = lambda t: "in flight" if t is None else f"{(t - rung_at) * 1000:.1f} ms"  # noqa: E731
    sent = "; ".join(f"sent {ms(b)}, back {ms(e)}, returned {r!r}" for b, e, r in fetches) or "none"
    died = task.done() and not task.cancelled() and task.exception()
    return (f"rings heard {sub.rings_heard - heard}; fetches since the ring: {sent}"
            + (f"; consumer died: {died!r}" if died else ""))


async def test_ring_wakes_an_idle_consumer_and_no_ring_waits_the_interval(bell_env):
    settings, topic, producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)  # only a ring wakes it
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    got, fetches = [], []
    task = asyncio.create_task(_consume(settings, topic, sub, got, fetches))
    try:
        await _warm_up(producer, topic, pub, got, task, sub)
        await asyncio.sleep(0.5)
        idle_fetches = len(fetches)
        await asyncio.sleep(1.0)
        # idle and unrung: no fetch loop spinning (a broker-side wait of 0 would spin here)
        assert len(fetches) - idle_fetches <= 1
        await producer.send_and_wait(topic, b"unrung")
        await asyncio.sleep(1.0)
        assert [v for v, _ in got] == [b"warm"], "a record was fetched without a ring before the idle interval"
        rung_at, heard, fetched = time.monotonic(), sub.rings_heard, len(fetches)
        pub.ring(topic)
        await until(lambda: len(got) == 2, 10, lambda: _since_ring(rung_at, sub, heard, fetches[fetched:], task))
        assert got[1][0] == b"unrung" and got[1][1] - rung_at < 10
        assert sub.rings_heard >= 1 and pub.rings_sent >= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.close()
        await pub.close()


async def test_a_lost_ring_costs_at_most_the_idle_interval(bell_env):
    settings, topic, producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=200)
    got, fetches = [], []
    task = asyncio.create_task(_consume(settings, topic, sub, got, fetches))
    try:
        await producer.send_and_wait(topic, b"never rung")
        await until(lambda: got, 30)  # no ring at all: the idle interval's fetch finds it
        assert got[0][0] == b"never rung"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.close()


async def test_a_ring_ahead_of_its_record_is_not_lost(bell_env):
    """Rings go out with the produce, before the broker acks it: a consumer that hears one and
    finds nothing yet keeps fetching for the expectation window (here 2 s, to make the test
    independent of the machine's speed), picks the record up without another ring, and then
    goes back to sleeping between empty fetches."""
    settings, topic, producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000, expect_ms=2_000)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    got, fetches = [], []
    task = asyncio.create_task(_consume(settings, topic, sub, got, fetches))
    try:
        await _warm_up(producer, topic, pub, got, task)
        await asyncio.sleep(2.5)  # past the window of the last ring
        heard = sub.rings_heard
        pub.ring(topic)  # the record is not there yet
        await until(lambda: sub.rings_heard > heard, 10)
        await asyncio.sleep(0.3)
        await producer.send_and_wait(topic, b"late record")  # and nobody rings for it
        await until(lambda: len(got) == 2, 10)  # the idle interval is a minute
        assert got[1][0] == b"late record"
        await asyncio.sleep(2.5)  # the window is over: sleeping between fetches again
        quiet = len(fetches)
        await asyncio.sleep(1.0)
        assert len(fetches) - quiet <= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.close()
        await pub.close()


async def _ring_until_heard(pub: Doorbell, sub: Doorbell, topic: str, timeout_s: float = 10) -> None:
    heard, deadline = sub.rings_heard, time.monotonic() + timeout_s
    while sub.rings_heard == heard:
        assert time.monotonic() < deadline, "no ring heard"
        pub.ring(topic)
        await asyncio.sleep(0.05)


async def _ring_conn_ids(redis) -> list[int]:
    return [c["id"] for c in await redis.client_list() if c.get("name") == RING_CLIENT_NAME]


async def test_rings_are_written_with_replies_off_and_a_killed_connection_is_replaced(bell_env):
    """A ring is a PUBLISH on the ring connection, whose replies the server never sends (nothing
    to read there after 50 rings); when that connection is killed, later rings open another."""
    settings, topic, _producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    sub._bells.setdefault(topic, _Bell(0.0))  # subscribe without a consumer
    sub._listener = asyncio.create_task(sub._listen())
    try:
        await _ring_until_heard(pub, sub, topic)
        heard = sub.rings_heard
        for _ in range(50):
            pub.ring(topic)
            await asyncio.sleep(0)
        await until(lambda: sub.rings_heard >= heard + 50, 10, lambda: f"heard {sub.rings_heard - heard} of 50")
        assert not await pub._wire._conn.can_read(), "the server replied on the ring connection"
        assert not pub._wire.pooled
        (first,) = await _ring_conn_ids(redis)
        await redis.execute_command("CLIENT", "KILL", "ID", first)
        await _ring_until_heard(pub, sub, topic)
        assert await _ring_conn_ids(redis) not in ([], [first])
    finally:
        await sub.close()
        await pub.close()
    deadline = time.monotonic() + 10  # close() disconnects the ring connection too
    while await _ring_conn_ids(redis):
        assert time.monotonic() < deadline, "the ring connection outlived close()"
        await asyncio.sleep(0.02)


async def test_a_ring_on_an_idle_connection_is_written_within_the_call(bell_env):
    """With the ring connection up and nothing queued, ``ring`` writes at once (the ring task
    would write a loop turn later, behind whatever is ready); each such ring is heard, in order
    with the carried payloads."""
    settings, topic, _producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    carried: list[bytes] = []
    sub.on_carried(topic, carried.append)  # subscribe without a consumer
    sub._listener = asyncio.create_task(sub._listen())
    try:
        await _ring_until_heard(pub, sub, topic)
        await asyncio.sleep(0.1)  # the first reply check (50 ms after connecting) is behind us
        pub._wire._check_at = asyncio.get_running_loop().time() + 60  # and the next not due
        heard, sent = sub.rings_heard, pub.rings_sent
        for i in range(20):
            pub.ring(topic, b"%d" % i)
            assert pub.rings_sent == sent + i + 1, "the ring was queued, not written"
        await until(lambda: sub.rings_heard >= heard + 20, 10, lambda: f"heard {sub.rings_heard - heard} of 20")
        assert carried[-20:] == [b"%d" % i for i in range(20)]
    finally:
        await sub.close()
        await pub.close()


async def test_a_server_that_keeps_replying_gets_plain_publishes(bell_env, redis_url):
    """An ACL that refuses CLIENT REPLY leaves replies on: the wire notices the unread replies
    and rings with pooled PUBLISH commands from then on, which are still heard."""
    settings, topic, _producer, redis = bell_env
    user, password = f"noreply-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-client")
    restricted = aioredis.from_url(redis_url, username=user, password=password)
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    pub = Doorbell(restricted, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    sub._bells.setdefault(topic, _Bell(0.0))
    sub._listener = asyncio.create_task(sub._listen())
    try:
        await _ring_until_heard(pub, sub, topic)
        deadline = time.monotonic() + 10
        while not pub._wire.pooled:  # the check runs on a write 50 ms after the connection opened
            assert time.monotonic() < deadline, "the replies were never noticed"
            pub.ring(topic)
            await asyncio.sleep(0.02)
        await _ring_until_heard(pub, sub, topic)
        heard = sub.rings_heard
        pub.ring_acked(topic, protocol.AckedRecord(partition=3, offset=9, request_id="pooled-1", attempt=0))
        await until(lambda: sub.rings_heard > heard, 10)  # heard, and its acked key written before it
        assert await redis.get(RedisKeys(settings.redis_prefix).acked(topic, "pooled-1", 0)) == b"3"
    finally:
        await sub.close()
        await pub.close()
        await restricted.aclose()
        await redis.execute_command("ACL", "DELUSER", user)


async def test_a_consumer_asleep_on_the_bell_stops_cleanly(bell_env):
    """``consumer.stop()`` cancels the fetch task and awaits it: a fetch asleep on the bell
    must end quietly, or the cancellation escapes ``stop()`` (and the runner's drain)."""
    settings, topic, producer, redis = bell_env
    bell = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=1)
    consumer.assign([TopicPartition(topic, 0)])
    await consumer.start()
    bell.attach(consumer, topic)
    try:
        await until(lambda: bool(consumer._fetcher._pending_tasks), 30)  # a fetch is out, then asleep
        await asyncio.sleep(0.3)
        await asyncio.wait_for(consumer.stop(), 10)  # a stop during a parked fetch must not raise CancelledError
    finally:
        await bell.close()


async def test_a_ring_its_callback_finds_nothing_to_fetch_in_wakes_nobody(bell_env):
    """``on_carried``'s callback returning False (an ack for a record delivered already) keeps the
    ring from waking the consumer; any other answer wakes it as before."""
    settings, topic, producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    answers = [False, None, True]
    sub.on_carried(topic, lambda payload: answers.pop(0))
    sub._listener = asyncio.create_task(sub._listen())
    bell = sub._bells[topic]
    try:
        await _ring_until_heard(pub, sub, topic)  # bare rings: no callback, they wake
        await asyncio.sleep(0.2)  # a second bare ring of that loop, if any, is heard by now
        woken, heard = bell.rings, sub.rings_heard
        for k in range(3):
            pub.ring(topic, b"payload")
            await until(lambda k=k: sub.rings_heard == heard + k + 1, 10)
        assert bell.rings == woken + 2  # the first ring woke nobody, the other two did
    finally:
        await sub.close()
        await pub.close()


async def test_a_carried_record_rings_again_once_acked_with_its_offset(bell_env):
    """``produce_all`` with ``carry``: a ring with the record's copy as it goes out, then one with
    a ``protocol.AckedRecord`` (its partition and offset, the request and attempt) once the broker
    acked it, written with the record's acked key: what lets an early run show its stream writes
    before its own fetch (shared.transport.early)."""
    settings, topic, producer, redis = bell_env
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=60_000)
    heard: list[bytes] = []
    sub.on_carried(topic, heard.append)
    sub._listener = asyncio.create_task(sub._listen())
    now = int(time.time() * 1000)
    msg = protocol.PrefillRequest(meta=protocol.RequestMeta(request_id="acked-1", model="m", created_unix_ms=now,
                                                            deadline_unix_ms=now + 60_000, prompt_token_ids=(1,),
                                                            attempt=2))
    try:
        await _ring_until_heard(pub, sub, topic)
        heard.clear()
        for _ in range(2):
            await produce_all(producer, [Produce(topic, "k", msg)], deadline_unix_ms=now + 60_000, doorbell=pub,
                              carry=True)
        await until(lambda: len(heard) >= 4, 10, lambda: f"heard {heard}")
        rings = [protocol.decoder_for(protocol.RingPayload).decode(p) for p in heard]
        assert [type(r).__name__ for r in rings] == ["CarriedRecord", "AckedRecord"] * 2
        assert rings[0].value == protocol.encode(msg)
        offsets = [r.offset for r in rings[1::2]]
        assert offsets[1] == offsets[0] + 1  # each its own record's offset
        assert all((r.partition, r.request_id, r.attempt) == (0, "acked-1", 2) for r in rings[1::2])
        # the ack's ring wrote, before it, the key an early run's guarded write checks in Redis
        acked_key = RedisKeys(settings.redis_prefix).acked(topic, "acked-1", 2)
        assert await redis.get(acked_key) == b"0" and 0 < await redis.pttl(acked_key) <= ACKED_TTL_MS
    finally:
        await sub.close()
        await pub.close()
