"""Early start against the real broker and Redis: a stage runner starts a record's work on the
copy its doorbell ring carries, shows nothing (outputs, stream writes) until Kafka delivers the
record, then adopts it: one output, one handler call. A copy whose record never comes changes
nothing and frees its claim. The copy's claim is asked for while its work runs: a claim held
elsewhere, or a done-mark, leaves that work unseen and the record takes the usual path."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys
from shared.settings import Settings
from shared.stage import Context, Outcome, Produce
from shared.transport.bus import ensure_topics, make_producer, produce_all
from shared.transport.doorbell import Doorbell
from shared.transport.ledger import CLAIMED, HELD, StageLedger
from shared.transport.runner import StageRunner
from shared.transport.streams import TokenStreams
from tests.transport.test_runner import _drain_topic, _start, _until


def _meta(rid: str) -> protocol.RequestMeta:
    now = int(time.time() * 1000)
    return protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now, deadline_unix_ms=now + 60_000,
                                prompt_token_ids=(1, 2, 3))


class Writer:
    """Writes one stream event per request, then passes the request on."""

    def __init__(self, out_topic: str) -> None:
        self.out = out_topic
        self.calls: list[str] = []
        self.write = True

    async def handle(self, msg, ctx):
        self.calls.append(msg.meta.request_id)
        if self.write:
            await ctx.events.append(msg.meta.request_id, protocol.TokenDelta(seq=0, token_ids=(7,), text="x"))
        return Outcome([Produce(self.out, msg.meta.request_id, msg)])


@pytest.fixture
async def early_env(kafka_bootstrap, redis_url):
    tag = uuid.uuid4().hex[:8]
    settings = Settings(kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, redis_prefix=f"t{tag}",
                        topic_partitions=1, drain_timeout_ms=300, kafka_session_timeout_ms=2_000,
                        early_start_confirm_ms=3_000)
    topic_in, topic_out = f"t.in.{tag}", f"t.out.{tag}"
    await ensure_topics(settings, (topic_in, topic_out))
    producer = make_producer(settings)
    await producer.start()
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(settings.redis_prefix)
    streams = TokenStreams(redis, keys, maxlen=1000, ttl_s=60)
    ledger = StageLedger(redis, keys, lease_ms=5_000, done_ttl_s=60)
    sub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=100)
    pub = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=100)
    handler = Writer(topic_out)
    ctx = Context(stage="s", worker_id="w1", events=streams, ledger=ledger)
    runner = StageRunner(stage="s", topic=topic_in, union=protocol.PrefillRequest, handler=handler, ctx=ctx,
                         producer=producer, settings=settings, doorbell=sub)
    task = await _start(runner)
    while not sub.rings_heard:  # the subscription is in: a ring from now on is heard
        pub.ring(topic_in)
        await asyncio.sleep(0.05)
    yield {"settings": settings, "in": topic_in, "out": topic_out, "producer": producer, "streams": streams,
           "ledger": ledger, "pub": pub, "runner": runner, "handler": handler}
    runner.stop()
    await asyncio.wait_for(task, 30)
    await pub.close()
    await sub.close()
    await producer.stop()
    await redis.aclose()


def _carry(env, msg) -> bytes:
    """Ring the runner's topic with a copy of ``msg`` (as produce_all does); its bytes."""
    value = protocol.encode(msg)
    env["pub"].ring(env["in"], protocol.encode(protocol.CarriedRecord(partition=0, sent_unix_ms=int(time.time() * 1000),
                                                                     value=value)))
    return value


async def test_the_copy_starts_the_work_and_nothing_shows_until_kafka_delivers_the_record(early_env):
    env = early_env
    rid = f"r-{uuid.uuid4().hex[:6]}"
    value = _carry(env, protocol.PrefillRequest(meta=_meta(rid)))
    await _until(lambda: env["handler"].calls == [rid], 10)
    await asyncio.sleep(0.3)  # the handler's stream write and its output wait for the record
    assert await env["streams"].history(rid) == []
    assert await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1, timeout_s=0.5) == []

    await env["producer"].send_and_wait(env["in"], value, key=rid.encode())
    out = await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1)
    assert [protocol.decoder_for(protocol.PrefillRequest).decode(v).meta.request_id for v in out] == [rid]
    assert len(await env["streams"].history(rid)) == 1
    await _until(lambda: env["runner"].processed == 1, 10)
    assert env["handler"].calls == [rid]  # adopted: the record did not run the handler again
    assert (env["runner"].early.started, env["runner"].early.adopted) == (1, 1)
    assert await env["ledger"].is_done(rid, "s", 0)


async def test_outputs_of_a_handler_that_writes_no_stream_wait_for_the_record(early_env):
    env = early_env
    env["handler"].write = False
    rid = f"r-{uuid.uuid4().hex[:6]}"
    value = _carry(env, protocol.PrefillRequest(meta=_meta(rid)))
    await _until(lambda: env["handler"].calls == [rid], 10)
    assert await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1, timeout_s=0.8) == []
    await env["producer"].send_and_wait(env["in"], value, key=rid.encode())
    assert len(await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1)) == 1
    await _until(lambda: env["runner"].processed == 1, 10)
    assert env["handler"].calls == [rid]


async def test_a_copy_whose_record_never_comes_changes_nothing_and_frees_its_claim(early_env):
    env = early_env
    rid = f"r-{uuid.uuid4().hex[:6]}"
    value = _carry(env, protocol.PrefillRequest(meta=_meta(rid)))
    await _until(lambda: env["handler"].calls == [rid], 10)
    # past early_start_confirm_ms (3 s) the run is dropped and its claim released
    await _until(lambda: not env["runner"].early._runs, 10)
    assert await env["streams"].history(rid) == []
    assert not await env["ledger"].is_done(rid, "s", 0)
    assert await env["ledger"].enter(rid, "s", 0, "probe") == CLAIMED  # nobody holds it
    await env["ledger"].release(rid, "s", 0, "probe")

    await env["producer"].send_and_wait(env["in"], value, key=rid.encode())  # late: it runs as usual
    out = await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1)
    assert len(out) == 1
    assert env["handler"].calls == [rid, rid]
    assert len(await env["streams"].history(rid)) == 1


async def test_a_claim_held_elsewhere_leaves_the_copys_work_unseen_and_the_record_waits_for_it(early_env):
    env = early_env
    rid = f"r-{uuid.uuid4().hex[:6]}"
    assert await env["ledger"].enter(rid, "s", 0, "other-worker") == CLAIMED
    value = _carry(env, protocol.PrefillRequest(meta=_meta(rid)))
    await env["producer"].send_and_wait(env["in"], value, key=rid.encode())
    await _until(lambda: env["handler"].calls == [rid], 10)  # the copy ran while its claim was asked for
    await asyncio.sleep(0.5)
    assert env["handler"].calls == [rid]  # the record waits for the claim, as a redelivery would
    assert await env["streams"].history(rid) == []  # the copy's stream write and output never showed
    assert await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1, timeout_s=0.3) == []
    assert await env["ledger"].enter(rid, "s", 0, "probe") == HELD  # the copy took nor freed it
    await env["ledger"].release(rid, "s", 0, "other-worker")
    out = await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1)
    assert len(out) == 1
    assert env["handler"].calls == [rid, rid]
    assert len(await env["streams"].history(rid)) == 1


async def test_a_copy_of_a_record_already_done_shows_nothing_and_the_record_is_not_run_again(early_env):
    env = early_env
    rid = f"r-{uuid.uuid4().hex[:6]}"
    await env["ledger"].mark_done(rid, "s", 0)
    value = _carry(env, protocol.PrefillRequest(meta=_meta(rid)))
    await env["producer"].send_and_wait(env["in"], value, key=rid.encode())
    await _until(lambda: env["runner"].processed == 1, 10)
    assert env["handler"].calls in ([], [rid])  # a copy heard after the record starts nothing
    assert await env["streams"].history(rid) == []
    assert await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=1, timeout_s=0.5) == []


async def test_produce_all_rings_with_the_record_and_the_stage_adopts_it(early_env):
    """The real path: produce_all carries each stage record on its ring (partition included).
    A ring normally beats the broker's fetch; on a loaded machine one may not, so several."""
    env = early_env
    rids = []
    for _ in range(10):
        rid = f"r-{uuid.uuid4().hex[:6]}"
        rids.append(rid)
        await produce_all(env["producer"], [Produce(env["in"], rid, protocol.PrefillRequest(meta=_meta(rid)))],
                          deadline_unix_ms=_meta(rid).deadline_unix_ms, doorbell=env["pub"], carry=True)
        await _until(lambda n=len(rids): env["runner"].processed == n, 10)
        if env["runner"].early.adopted:
            break
    assert env["runner"].early.adopted >= 1
    out = await _drain_topic(env["settings"].kafka_bootstrap, env["out"], want=len(rids))
    decoded = sorted(protocol.decoder_for(protocol.PrefillRequest).decode(v).meta.request_id for v in out)
    assert decoded == sorted(rids)  # each once
    assert sorted(env["handler"].calls) == sorted(rids)
