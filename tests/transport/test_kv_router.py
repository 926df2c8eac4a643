"""The routing table and the router against a real Redis (shared.kv.table, shared.kv.router)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition

from shared import protocol
from shared.keys import TOPIC_PREFILL, RedisKeys
from shared.kv.blocks import block_hashes
from shared.kv.prefix_cache import CacheChanges
from shared.kv.router import Router
from shared.kv.table import COALESCE_S, LoadReporter, LoadTracker, TableWriter
from shared.settings import Settings
from shared.transport.redis_lean import lean_of
from tests.roundtrips import count_round_trips

PH = 99
BLOCK = 4


def request(tokens: list[int]) -> protocol.PrefillRequest:
    meta = protocol.RequestMeta(request_id=uuid.uuid4().hex, model="m", deadline_unix_ms=0, created_unix_ms=0,
                                prompt_token_ids=tuple(tokens))
    return protocol.PrefillRequest(meta=meta)


@pytest.fixture
async def table(redis_url):
    settings = Settings(redis_url=redis_url, redis_prefix=f"kv{uuid.uuid4().hex[:8]}", kv_block_size=BLOCK,
                        kv_report_ttl_ms=5_000)
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(settings.redis_prefix)
    loads = {w: LoadTracker() for w in ("w1", "w2")}
    reporters = {w: LoadReporter(redis, keys, w, loads[w], settings) for w in loads}
    await reporters["w1"].on_partitions_assigned([TopicPartition(TOPIC_PREFILL, p) for p in (0, 1)])
    await reporters["w2"].on_partitions_assigned([TopicPartition(TOPIC_PREFILL, p) for p in (2, 3)])
    writers = {w: TableWriter(redis, keys, w, settings) for w in ("w1", "w2", "w3")}
    tasks = [asyncio.create_task(w.run()) for w in writers.values()]
    yield {"settings": settings, "redis": redis, "keys": keys, "loads": loads, "reporters": reporters,
           "writers": writers}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await redis.aclose()


def router(t, policy: str = "kv", **kw) -> Router:
    s = t["settings"].with_overrides(routing_policy=policy, **kw)
    return Router(t["redis"], t["keys"], s, PH)


async def stored(t, worker: str, hashes: list[int], removed: list[int] = (), cleared: bool = False) -> None:
    """``worker``'s cache changed so; wait for its table write."""
    t["writers"][worker].changed(CacheChanges(list(hashes), list(removed), cleared))
    assert await t["writers"][worker].flush()


async def test_the_worker_holding_the_prefix_wins_on_one_of_its_partitions(table):
    prompt = list(range(100, 120))  # 5 blocks
    await stored(table, "w1", block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK)[:3])
    d = await router(table).decide(request(prompt))
    assert (d.worker_id, d.reason, d.overlap) == ("w1", "kv_hit", 3) and d.partition in (0, 1)
    # overlap counts leading blocks only: a hole at block 0 is no hit
    other = [1] + prompt[1:]
    d = await router(table).decide(request(other))
    assert d.overlap == 0 and d.reason == "load"


async def test_removed_blocks_stop_attracting(table):
    prompt = list(range(200, 216))
    hashes = block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK)
    await stored(table, "w2", hashes)
    assert (await router(table).decide(request(prompt))).worker_id == "w2"
    await stored(table, "w2", [], removed=hashes[:1])
    assert (await router(table).decide(request(prompt))).overlap == 0


async def test_a_cleared_change_replaces_what_the_worker_held(table):
    """``cleared`` (an engine's AllBlocksCleared, or a resync of its event translation) drops
    every block the table listed for the worker before the change's own ``stored``."""
    a, b = (block_hashes(list(range(s, s + 8)), [], placeholder_id=PH, block_size=BLOCK) for s in (300, 400))
    await stored(table, "w1", a)
    await stored(table, "w1", b, cleared=True)
    held = {int(x) for x in await table["redis"].smembers(table["keys"].kv_blocks("w1"))}
    assert held == set(b)


async def test_changes_made_while_a_write_is_out_fold_into_the_next_in_order(table):
    """One write at a time: what changes meanwhile is folded (a block stored then removed is
    not listed) and goes in one pipeline, and the set ends as the cache holds it."""
    w = table["writers"]["w1"]
    await stored(table, "w1", [1])
    written = w.written
    w.changed(CacheChanges([2, 3]))  # the write of these starts on the next loop turn
    w.changed(CacheChanges([4], removed=[2]))
    w.changed(CacheChanges([], removed=[1]))
    assert await w.flush()
    held = {int(x) for x in await table["redis"].smembers(table["keys"].kv_blocks("w1"))}
    assert held == {3, 4} and w.written == written + 1


async def test_a_failed_write_is_followed_by_a_whole_rewrite_of_the_workers_blocks(table):
    """A write Redis refused leaves the set unknown: the next replaces it with every block the
    worker's cache holds, the failed write's changes included."""
    w, key = table["writers"]["w2"], table["keys"].kv_blocks("w2")
    await stored(table, "w2", [1, 2])
    await table["redis"].set(key, "not a set")  # SADD fails on it (WRONGTYPE) until the key is replaced
    w.changed(CacheChanges([3], removed=[1]))
    assert await w.flush()
    assert {int(x) for x in await table["redis"].smembers(key)} == {2, 3}


async def test_with_no_information_load_is_spread_and_a_loaded_worker_avoided(table):
    r = router(table)
    picks = Counter([(await r.decide(request([5] * 9))).worker_id for _ in range(40)])
    assert set(picks) == {"w1", "w2"}, picks
    with table["loads"]["w1"].track(400):
        await table["reporters"]["w1"].report()
        picks = Counter([(await r.decide(request([5] * 9))).worker_id for _ in range(10)])
    assert picks == {"w2": 10}
    # a small overlap does not outweigh a long queue; a large weight does
    prompt = list(range(300, 340))
    await stored(table, "w1", block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK)[:2])
    with table["loads"]["w1"].track(400):
        await table["reporters"]["w1"].report()
        assert (await r.decide(request(prompt))).worker_id == "w2"
        assert (await router(table, kv_overlap_weight=100.0).decide(request(prompt))).worker_id == "w1"


async def test_equally_cheap_workers_go_to_the_one_holding_fewer_blocks(table):
    """A new session (no overlap anywhere, equal loads) goes where fewer sessions' blocks live,
    so sessions spread instead of piling where random ties fell."""
    await stored(table, "w1", block_hashes(list(range(500, 540)), [], placeholder_id=PH, block_size=BLOCK))
    r = router(table)
    assert {(await r.decide(request(list(range(600, 640))))).worker_id for _ in range(10)} == {"w2"}
    with table["loads"]["w2"].track(0):  # a request in flight on w2 outranks w1's blocks
        await table["reporters"]["w2"].report()
        assert (await r.decide(request(list(range(600, 640))))).worker_id == "w1"


async def test_round_robin_takes_workers_in_turn(table):
    r = router(table, "round_robin")
    picks = [(await r.decide(request([1, 2, 3, 4]))).worker_id for _ in range(6)]
    assert picks in (["w1", "w2"] * 3, ["w2", "w1"] * 3)


async def test_a_rebalance_moves_partitions_and_stale_owners_are_ignored(table):
    t = table
    await t["reporters"]["w1"].on_partitions_revoked([TopicPartition(TOPIC_PREFILL, 1)])
    await t["reporters"]["w2"].on_partitions_assigned([TopicPartition(TOPIC_PREFILL, p) for p in (1, 2, 3)])
    views = {w.worker_id: w.partitions for w in await router(t).workers([])}
    assert views == {"w1": (0,), "w2": (1, 2, 3)}
    # a stale field naming w1 for partition 3 (w1 does not list it) is not trusted
    await t["redis"].hset(t["keys"].kv_owners(TOPIC_PREFILL), "3", "w1")
    views = {w.worker_id: w.partitions for w in await router(t).workers([])}
    assert views == {"w1": (0,), "w2": (1, 2)}
    # a worker no longer heard from (its load record expired) is not routed to
    await t["redis"].delete(t["keys"].kv_load("w1"))
    assert {w.worker_id for w in await router(t).workers([])} == {"w2"}


async def test_one_round_trip_per_decision_and_a_rebalance_is_seen_at_once(table, monkeypatch):
    """The same router across calls: in the steady state a decision is one Redis pipeline
    (the owners map read beside the loads of the workers it named last time); a worker that
    joins or leaves between two calls is in (out of) the very next decision."""
    t, r = table, router(table)
    sent = count_round_trips(monkeypatch, t["redis"])
    prompt = list(range(500, 516))
    await r.decide(request(prompt))  # first call: learns who owns what (two round trips)
    sent.clear()
    for _ in range(3):
        assert (await r.decide(request(prompt))).worker_id in ("w1", "w2")
    assert len(sent) == 3, sent  # one round trip each
    # w3 takes partition 1 from w1: the next decision sees it (the pipeline is sent again for it)
    w3 = LoadReporter(t["redis"], t["keys"], "w3", LoadTracker(), t["settings"])
    await t["reporters"]["w1"].on_partitions_revoked([TopicPartition(TOPIC_PREFILL, 1)])
    await w3.on_partitions_assigned([TopicPartition(TOPIC_PREFILL, 1)])
    await stored(t, "w3", block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK))
    sent.clear()
    d = await r.decide(request(prompt))
    assert (d.worker_id, d.partition, d.reason) == ("w3", 1, "kv_hit") and len(sent) == 2
    # and once w3 is gone from the owners map, it is no candidate any more
    await t["redis"].hdel(t["keys"].kv_owners(TOPIC_PREFILL), "1")
    assert {w.worker_id for w in await r.workers([])} == {"w1", "w2"}


async def test_no_table_or_no_redis_means_key_hashing(redis_url):
    s = Settings(redis_url=redis_url, redis_prefix=f"kv{uuid.uuid4().hex[:8]}")
    redis = aioredis.from_url(redis_url)
    try:
        r = Router(redis, RedisKeys(s.redis_prefix), s, PH)
        assert await r.decide(request([1, 2])) == (await r.decide(request([1, 2])))
        assert (await r.decide(request([1, 2]))).reason == "no_table"
        assert (await r.route(request([1, 2])))[0] is None
    finally:
        await redis.aclose()
    gone = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    try:
        assert (await Router(gone, RedisKeys("x"), s, PH).route(request([1, 2])))[0] is None
    finally:
        await gone.aclose()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing_policy"):
        Router(None, RedisKeys("x"), Settings(routing_policy="random"), PH)


async def test_routing_notes_say_why_a_prefill_missed_and_event_lag_is_sampled(table):
    from shared.kv import audit

    prompt = list(range(300, 316))  # 4 blocks
    hashes = block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK)
    await stored(table, "w2", hashes[:2])
    r = router(table)
    partition, msg = await r.route(request(prompt))  # the decision travels in the record
    assert partition in (2, 3)
    notes = audit.RouteAudit(table["writers"]["w2"], table["keys"])
    notes.prefilled(msg, "w2", 1)  # one of the two listed blocks was gone
    await notes.drain()
    note = await audit.read_notes(table["settings"].redis_url, table["settings"].redis_prefix, [msg.meta.request_id])
    n = note[msg.meta.request_id]
    assert (n.route.policy, n.route.worker, n.route.overlap, n.route.best, n.route.blocks, n.route.candidates) == \
        ("kv", "w2", 2, 2, 4, 2)
    assert (n.ran_on, n.cause, n.hit) == ("w2", "evicted", 1)
    unrouted = request(prompt)  # no decision in the record: the note says so
    notes.prefilled(unrouted, "w1", 0)
    await notes.drain()
    note = await audit.read_notes(table["settings"].redis_url, table["settings"].redis_prefix,
                                  [unrouted.meta.request_id])
    assert note[unrouted.meta.request_id] == protocol.RouteOutcome(route=None, ran_on="w1", hit=0, cause="unrouted")

    lags = await audit.read_lags(table["settings"].redis_url, table["settings"].redis_prefix)
    assert len(lags) == 1 and 0 <= lags[0] < 60_000  # w2's change above, into the table
    w1 = table["writers"]["w1"]
    w1.changed(CacheChanges([1]))
    w1.changed(CacheChanges([2]))
    time.sleep(0.2)  # the loop blocked: both changes wait 200 ms for their write
    assert await w1.flush()
    lags = await audit.read_lags(table["settings"].redis_url, table["settings"].redis_prefix)
    assert len(lags) == 3 and all(200 <= lag < 60_000 for lag in lags[:2])


async def test_a_change_of_load_writes_the_load_alone_and_the_interval_writes_everything(table):
    t = table
    s = t["settings"].with_overrides(kv_report_interval_ms=400)
    load = LoadTracker()
    w9 = LoadReporter(t["redis"], t["keys"], "w9", load, s)
    await w9.on_partitions_assigned([TopicPartition(TOPIC_PREFILL, 7)])
    task = asyncio.create_task(w9.run())
    try:
        await asyncio.sleep(0.05)  # its first report (a full one) is out
        await t["redis"].hdel(t["keys"].kv_owners(TOPIC_PREFILL), "7")
        t0 = time.monotonic()
        with load.track(64):
            while (await t["redis"].hget(t["keys"].kv_load("w9"), "inflight")) != b"1":
                assert time.monotonic() - t0 < 0.3, "a change of load was not reported at once"
                await asyncio.sleep(0.01)
            assert await t["redis"].hget(t["keys"].kv_owners(TOPIC_PREFILL), "7") is None  # the load alone
            while await t["redis"].hget(t["keys"].kv_owners(TOPIC_PREFILL), "7") != b"w9":
                assert time.monotonic() - t0 < 2.0, "the full report did not come within its interval"
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not await t["redis"].exists(t["keys"].kv_load("w9"))  # withdrawn on the way out


async def test_a_change_of_load_undone_within_the_window_writes_nothing(table, monkeypatch):
    """A prompt prefilled within ``COALESCE_S`` leaves the load as the table holds it: no write
    (the report's round trip would run beside the forward). A change that lasts is written once."""
    t = table
    load = LoadTracker()
    w8 = LoadReporter(t["redis"], t["keys"], "w8", load, t["settings"].with_overrides(kv_report_interval_ms=60_000))
    task = asyncio.create_task(w8.run())
    try:
        while not await t["redis"].exists(t["keys"].kv_load("w8")):  # its first (full) report
            await asyncio.sleep(0.01)
        sent = count_round_trips(monkeypatch, t["redis"])
        for _ in range(3):
            with load.track(64):
                await asyncio.sleep(COALESCE_S / 5)
            await asyncio.sleep(COALESCE_S * 3)
        assert sent == []
        with load.track(64):
            t0 = time.monotonic()
            while (await t["redis"].hget(t["keys"].kv_load("w8"), "queued_tokens")) != b"64":
                assert time.monotonic() - t0 < 0.5, "a lasting change of load was not reported"
                await asyncio.sleep(0.01)
            assert sent.count(2) == 1  # one write: the load and its TTL
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_read_ahead_moves_the_round_trip_off_the_produce_point(table, monkeypatch):
    """encode reads the table while its encoder runs: the decision at the produce point then
    makes no round trip and is the one a read made there would give. A read-ahead for other
    blocks, or older than READ_AHEAD_MAX_AGE_S, is not used (the table is read again)."""
    t, r = table, router(table)
    prompt = list(range(700, 720))  # 5 blocks, 3 of them held by w2
    await stored(t, "w2", block_hashes(prompt, [], placeholder_id=PH, block_size=BLOCK)[:3])
    await r.decide(request(prompt))  # learns who owns what
    sent = count_round_trips(monkeypatch, t["redis"])
    msg = request(prompt)
    r.read_ahead(msg.meta.request_id, msg.meta.prompt_token_ids, msg.items)
    await asyncio.sleep(0.05)  # the encoder's time: the read is back by the produce point
    assert len(sent) == 1
    sent.clear()
    d = await r.decide(msg)
    assert sent == [] and (d.worker_id, d.overlap, d.reason) == ("w2", 3, "kv_hit")
    # the read-ahead is used once: a second decision for the same request reads again
    assert (await r.decide(msg)).worker_id == "w2" and len(sent) == 1
    sent.clear()
    # read ahead for other blocks (the request's items changed): read again at the produce point
    other = request(list(range(800, 820)))
    r.read_ahead(other.meta.request_id, prompt, ())
    d = await r.decide(other)
    assert d.overlap == 0 and sent, sent  # other's own blocks (the read-ahead's would overlap w2's 3)
    sent.clear()
    # too old: read again
    monkeypatch.setattr("shared.kv.router.READ_AHEAD_MAX_AGE_S", 0.01)
    msg = request(prompt)
    r.read_ahead(msg.meta.request_id, msg.meta.prompt_token_ids, msg.items)
    await asyncio.sleep(0.05)
    sent.clear()
    assert (await r.decide(msg)).worker_id == "w2" and len(sent) == 1


async def test_read_aheads_that_are_never_used_are_bounded(table, monkeypatch):
    """Requests that fail before producing leave their read-ahead behind: at most
    _READ_AHEAD_MAX are kept (the oldest go), and none of them logs an unretrieved error."""
    r = router(table)
    monkeypatch.setattr("shared.kv.router._READ_AHEAD_MAX", 4)
    for i in range(10):
        r.read_ahead(f"gone-{i}", [1, 2, 3, 4, 5], ())
    assert list(r._ahead) == [f"gone-{i}" for i in range(6, 10)]
    await asyncio.sleep(0.05)


async def test_a_read_ahead_that_failed_is_read_again(redis_url):
    """Redis away during the read-ahead and back for the decision: the decision reads again."""
    s = Settings(redis_url=redis_url, redis_prefix=f"kv{uuid.uuid4().hex[:8]}", kv_block_size=BLOCK)
    gone = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.2)
    r = Router(gone, RedisKeys(s.redis_prefix), s, PH)
    msg = request([1, 2, 3, 4, 5])
    r.read_ahead(msg.meta.request_id, msg.meta.prompt_token_ids, msg.items)
    await asyncio.sleep(0.3)
    live = aioredis.from_url(redis_url)
    try:
        r._redis, r._lean = live, lean_of(live)
        d = await r.decide(msg)
        assert (d.worker_id, d.reason) == (None, "no_table")  # read, found nothing: no error
    finally:
        await lean_of(live).close()
        await live.aclose()
        await gone.aclose()
