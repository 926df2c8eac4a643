"""Infrastructure stalls against a real redis-server and broker that each test starts and pauses
(SIGSTOP, then SIGCONT): a stalled Redis or broker is a 503 with Retry-After within its bound
(``redis_timeout_ms`` plus the token-stream read's block; ``queue_retry_ms``), never a 500 or a
wait past it; a prefill+decode worker rides out a Redis stall of 30 s and finishes its records
once Redis answers again. A Redis that refuses the login is configuration, not an outage: it
stops a runner (and a worker at start) instead of being retried."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from contextlib import contextmanager

import aiohttp
import pytest
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services import worker as worker_mod
from services.gateway.auth import hash_key
from services.stages import fleet_topics
from shared import protocol
from shared import settings as settings_mod
from shared.keys import TOPIC_PREFILL, RedisKeys
from shared.stage import Context, Outcome, Produce, entry_message
from shared.transport.bus import ensure_topics, make_producer
from shared.transport.ledger import StageLedger
from shared.transport.redis_conn import make_redis, unavailable
from shared.transport.runner import StageRunner
from shared.transport.streams import TokenStreams
from tests import procs

REDIS_TIMEOUT_MS = 1_000
READ_BLOCK_S = 1.0  # TokenStreams' read_block_ms: a stream read already blocking may take that on top
QUEUE_RETRY_MS = 2_000
MARGIN_S = 1.5  # two shared cores: scheduling, not the bound
STALL_S = 31.0  # the worker must ride out at least 30 s
KEY_LIMITED, KEY_FREE = "sk-stall-limited", "sk-stall-free"  # the first's rate is counted in Redis


@contextmanager
def _paused(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _settings(**kw) -> settings_mod.Settings:
    return settings_mod.from_env({}, redis_prefix=f"stall-{uuid.uuid4().hex[:8]}", ingress_enabled=False,
                                 metrics_port=0, **kw)




async def _chat(http: aiohttp.ClientSession, base: str, model: str, key: str) -> tuple[int, str | None, dict, float]:
    """(status, Retry-After, body, monotonic time of the answer)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    async with http.post(base + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        text = await resp.text()
        try:
            body = json.loads(text)
        except ValueError:  # not even the OpenAI shape (aiohttp's own 500)
            body = {"error": {"code": None, "message": text[:200]}}
        return resp.status, resp.headers.get("Retry-After"), body, time.monotonic()


def _assert_503(answer, *, code: str, t0: float, bound_s: float) -> None:
    status, retry_after, body, at = answer
    print(f"\n{status} {body['error'].get('code')} {at - t0:.2f} s after the stall began (bound {bound_s} s)")
    assert (status, body["error"]["code"]) == (503, code), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert retry_after is not None and int(retry_after) >= 1
    assert at - t0 <= bound_s + MARGIN_S, f"answered {at - t0:.1f} s after the stall began; bound {bound_s} s"


async def test_a_redis_stall_is_a_503_with_retry_after_within_redis_timeout(kafka_bootstrap, model_dir, tmp_path):
    """Three ways a request meets the stall: already following its token stream (no worker here
    writes it), the key's rate charge, and the routing read of a text-only request."""
    pids: list[int] = []
    with procs.redis_server(tmp_path, pids=pids) as url:
        s = _settings(kafka_bootstrap=kafka_bootstrap, redis_url=url, model=str(model_dir),
                      redis_timeout_ms=REDIS_TIMEOUT_MS,
                      api_key_hashes=(hash_key(KEY_LIMITED) + ":1000", hash_key(KEY_FREE) + ":0"))
        bound_s = s.redis_timeout_ms / 1000 + READ_BLOCK_S
        timeout = aiohttp.ClientTimeout(total=60)
        async with procs.in_process_gateway(s) as base, aiohttp.ClientSession(timeout=timeout) as http:
            following = asyncio.create_task(_chat(http, base, s.served_model_name, KEY_FREE))
            await asyncio.sleep(1.0)  # queued; its stream has nobody to write it
            assert not following.done()
            with _paused(pids[0]):
                t0 = time.monotonic()
                charged, routed = await asyncio.gather(_chat(http, base, s.served_model_name, KEY_LIMITED),
                                                       _chat(http, base, s.served_model_name, KEY_FREE))
                followed = await following
            for answer in (followed, charged, routed):
                _assert_503(answer, code="store_unavailable", t0=t0, bound_s=bound_s)
            async with http.get(base + "/ready") as resp:  # Redis back: only the workers this test has none of
                body = await resp.json()
                assert not [p for p in body["problems"] if p.startswith(("redis", "kafka", "workers"))], body
                assert body["missing_stages"] == ["media-fetch", "encode", "prefill", "decode"], body


async def test_a_broker_stall_is_a_503_within_queue_retry_ms(redis_url, model_dir, tmp_path):
    pids: list[int] = []
    with procs.broker(tmp_path, pids=pids) as bootstrap:  # its own: the module's broker stays unpaused
        s = _settings(kafka_bootstrap=bootstrap, redis_url=redis_url, model=str(model_dir),
                      queue_retry_ms=QUEUE_RETRY_MS)
        timeout = aiohttp.ClientTimeout(total=90)  # aiokafka alone waits 30 s for a broker that does not answer
        async with procs.in_process_gateway(s) as base, aiohttp.ClientSession(timeout=timeout) as http:
            with _paused(pids[0]):
                t0 = time.monotonic()
                answer = await _chat(http, base, s.served_model_name, "unused")
            _assert_503(answer, code="queue_unavailable", t0=t0, bound_s=s.queue_retry_ms / 1000)


def _entry(rid: str, max_tokens: int) -> protocol.PrefillRequest:
    now = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now, deadline_unix_ms=now + 120_000,
                                prompt_token_ids=(10, 11, 12, 13, 14),  # text tokens (5 and 6 hold media)
                                sampling=protocol.Sampling(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    produce = entry_message(meta)
    assert produce.topic == TOPIC_PREFILL
    return produce.value


async def _completion(streams: TokenStreams, rid: str) -> tuple[list[protocol.TokenDelta], protocol.StreamEvent]:
    deltas = []
    async for ev in streams.follow(rid, deadline_s=asyncio.get_running_loop().time() + 60):
        if isinstance(ev, protocol.TokenDelta):
            deltas.append(ev)
        else:
            return deltas, ev
    raise AssertionError(f"{rid}: no terminal event")


def _assert_whole(deltas: list[protocol.TokenDelta], last: protocol.StreamEvent, max_tokens: int) -> None:
    assert isinstance(last, protocol.Finish), last
    n = 0
    for d in deltas:  # each token once, in order: nothing lost or written twice by the retries
        assert d.seq == n, [x.seq for x in deltas]
        n += len(d.token_ids)
    assert n == max_tokens == last.usage.completion_tokens


async def test_a_worker_rides_out_a_30_s_redis_stall_and_finishes_its_records(
        kafka_bootstrap, model_dir, tmp_path, monkeypatch):
    """One record is mid-decode when Redis stops, another arrives while it is stopped."""
    runners: list[StageRunner] = []

    class Seen(StageRunner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            runners.append(self)

    monkeypatch.setattr(worker_mod, "StageRunner", Seen)
    pids: list[int] = []
    with procs.redis_server(tmp_path, pids=pids) as url:
        s = _settings(kafka_bootstrap=kafka_bootstrap, redis_url=url, model=str(model_dir),
                      redis_timeout_ms=REDIS_TIMEOUT_MS)
        await ensure_topics(s, fleet_topics(s))
        redis = make_redis(s)
        streams = TokenStreams(redis, RedisKeys(s.redis_prefix), maxlen=10_000, ttl_s=600)
        producer = make_producer(s)
        await producer.start()
        worker = asyncio.create_task(worker_mod.run_worker(s, ["prefill", "decode"]))
        try:
            async with asyncio.timeout(120):
                while not (runners and all(r.assigned.is_set() for r in runners)):
                    assert not worker.done(), worker.result()
                    await asyncio.sleep(0.1)
            long, late = (f"stall-{uuid.uuid4().hex[:8]}-{n}" for n in ("long", "late"))
            await producer.send_and_wait(TOPIC_PREFILL, protocol.encode(_entry(long, 400)), key=long.encode())
            first = streams.follow(long, deadline_s=asyncio.get_running_loop().time() + 60)
            assert isinstance(await anext(first), protocol.TokenDelta)  # decoding now
            await first.aclose()
            with _paused(pids[0]):
                await producer.send_and_wait(TOPIC_PREFILL, protocol.encode(_entry(late, 8)), key=late.encode())
                await asyncio.sleep(STALL_S)
                assert not worker.done(), f"the worker exited during the stall: {worker.result()!r}"
            resumed = time.monotonic()
            for rid, max_tokens in ((long, 400), (late, 8)):
                _assert_whole(*await _completion(streams, rid), max_tokens)
            print(f"\nafter a {STALL_S:.0f} s Redis stall both records finished {time.monotonic() - resumed:.1f} s "
                  "after Redis resumed")
            assert not worker.done()
        finally:
            for r in runners:
                r.stop()
            rc = await asyncio.wait_for(worker, 60)
            await producer.stop()
            await streams.close()
            await redis.aclose()
    assert rc == 0


class _FlakyLedger(StageLedger):
    """A real ledger whose claims first fail with ``errors``, one per try."""

    def __init__(self, *args, errors: list[BaseException], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.errors = errors
        self.tries = 0

    async def enter_waiting(self, *args, **kwargs) -> int:
        self.tries += 1
        if self.errors:
            raise self.errors.pop(0)
        return await super().enter_waiting(*args, **kwargs)


class _Forward:
    def __init__(self, topic: str) -> None:
        self.topic = topic

    async def handle(self, msg, ctx):
        return Outcome([Produce(self.topic, msg.meta.request_id, msg)])


@pytest.mark.parametrize("fault", ["outage", "refused"])
async def test_a_record_rides_out_an_unavailable_redis_but_a_refused_login_stops_the_runner(
        kafka_bootstrap, redis_url, fault):
    s = _settings(kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, topic_partitions=2, fetch_max_wait_ms=10,
                  drain_timeout_ms=300, kafka_session_timeout_ms=2_000, doorbell=False)
    tag = uuid.uuid4().hex[:8]
    topic_in, topic_out = f"stall.in.{tag}", f"stall.out.{tag}"
    await ensure_topics(s, (topic_in, topic_out))
    errors = [RedisTimeoutError("stalled"), RedisConnectionError("gone")] if fault == "outage" else \
        [AuthenticationError("invalid username-password pair")]
    redis = make_redis(s)
    ledger = _FlakyLedger(redis, RedisKeys(s.redis_prefix), lease_ms=5_000, done_ttl_s=60, errors=errors)
    streams = TokenStreams(redis, RedisKeys(s.redis_prefix), maxlen=100, ttl_s=60)
    producer = make_producer(s)
    await producer.start()
    runner = StageRunner(stage=f"stall-{tag}", topic=topic_in, union=protocol.PrefillRequest,
                         handler=_Forward(topic_out), ctx=Context(stage="s", worker_id="w", events=streams,
                                                                  ledger=ledger),
                         producer=producer, settings=s)
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.assigned.wait(), 30)
        rid = f"r-{tag}"
        await producer.send_and_wait(topic_in, protocol.encode(_entry(rid, 4)), key=rid.encode())
        if fault == "refused":  # configuration: no retry, the runner ends with it (the worker exits 1)
            with pytest.raises(AuthenticationError):
                await asyncio.wait_for(task, 30)
            assert ledger.tries == 1
            return
        async with asyncio.timeout(30):
            while runner.processed < 1:
                assert not task.done(), task
                await asyncio.sleep(0.05)
        assert ledger.tries == 3 and await ledger.is_done(rid, runner.stage, 0)  # no attempt spent, no dead letter
    finally:
        runner.stop()
        await asyncio.gather(task, return_exceptions=True)
        await producer.stop()
        await streams.close()
        await redis.aclose()


async def test_a_redis_that_refuses_the_workers_login_stops_it_at_start(kafka_bootstrap, model_dir, tmp_path):
    """Configuration, not an outage: never retried, the process ends saying why."""
    assert unavailable(RedisTimeoutError()) and unavailable(RedisConnectionError())
    assert not unavailable(AuthenticationError())
    with procs.redis_server(tmp_path, password="stall-Pa55") as url:
        s = _settings(kafka_bootstrap=kafka_bootstrap, redis_url=url, model=str(model_dir),
                      redis_password="wrong")
        with pytest.raises(SystemExit, match="did not answer") as info:
            await worker_mod.run_worker(s, ["prefill", "decode"])
        assert "wrong" not in str(info.value)
