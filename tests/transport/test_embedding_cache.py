"""The embedding cache against real Redis and real NIXL agents (two "encode workers" and a
"prefill" in one process): store bounds and eviction order, coalescing within and across
workers, a dead lease holder, validation of lease-less reads, Redis flushed."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import torch

from shared import protocol
from shared.embcache.coalesce import EncodeCache
from shared.embcache.identity import cache_key
from shared.embcache.index import EmbeddingIndex
from shared.embcache.pull import EmbeddingPuller
from shared.embcache.recent import RecentEmbeddings
from shared.embcache.store import EmbeddingStore
from shared.keys import RedisKeys
from shared.stage import Context
from shared.transfer import OwnerGoneError, TransferAgent
from tests.fakes import ListSink

EMB = (4, 32)  # rows x hidden of a test embedding (512 B)


def emb(seed: int) -> torch.Tensor:
    return torch.arange(EMB[0] * EMB[1], dtype=torch.float32).reshape(EMB) * 0.5 + seed


def pixel_item(key: str, index: int = 0) -> protocol.PixelItem:
    dummy = protocol.TensorRef("media", 0, 4, 0, 1, "float32", (1,))
    return protocol.PixelItem(index=index, mm_hash=key, grid_thw=(1, 4, 4), n_tokens=EMB[0], pixels=dummy,
                              cache_key=key)


@pytest_asyncio.fixture
async def env(redis_url):
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    index = EmbeddingIndex(redis, keys, ttl_s=60, lease_ms=400)
    agents = [TransferAgent(f"{n}-{os.getpid()}-{uuid.uuid4().hex[:6]}", 1 << 20) for n in ("enc0", "enc1", "pre")]
    for a in agents:
        await a.start()
        await redis.set(keys.alive(a.name), b"1", px=60_000)  # their processes run
    try:
        yield redis, keys, index, agents
    finally:
        for a in agents:
            await a.stop()
        await redis.aclose()


def make_cache(index, agent, capacity=1 << 16, wait_ms=5_000, fraction=0.5) -> tuple[EncodeCache, EmbeddingStore]:
    store = EmbeddingStore(agent, index, capacity_bytes=capacity, max_item_fraction=fraction)
    return EncodeCache(store, index, agent, agent.name, wait_ms=wait_ms, poll_ms=5), store


class CountingEncoder:
    """The encode callback: counts forwards; slow enough that concurrent requests overlap."""

    def __init__(self, agent: TransferAgent, delay_s: float = 0.1) -> None:
        self.agent, self.delay_s, self.calls = agent, delay_s, 0

    def __call__(self, seed: int):
        async def encode() -> protocol.TensorRef:
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            return self.agent.put(emb(seed))
        return encode


async def test_store_is_bounded_in_bytes_and_evicts_index_entry_before_the_slot(env) -> None:
    redis, keys, index, (a, _, _) = env
    store = EmbeddingStore(a, index, capacity_bytes=3 * 512, max_item_fraction=0.4)
    refs = [a.put(emb(i)) for i in range(4)]
    cached = [await store.insert(f"k{i}", r, (1, 4, 4), 4) for i, r in enumerate(refs)]
    assert all(c is not None for c in cached) and len(store) == 3 and store.bytes == 3 * 512
    assert store.get("k0") is None and await index.lookup("k0") is None  # evicted: entry gone
    assert (await index.lookup("k3")).gen == cached[3].gen
    for r in refs:  # the producers' consumers release: cached slots stay, the evicted one goes
        a.free_local(r.lease)
    assert a.stats()["used_bytes"] == 3 * 512 and a.stats()["pinned_slots"] == 3
    big = a.put(torch.zeros(1024, dtype=torch.float32))  # 4 KiB > 0.4 x capacity
    assert await store.insert("big", big, (1, 4, 4), 4) is None
    await store.close()
    assert await index.lookup("k3") is None and a.stats()["pinned_slots"] == 0


async def test_evictions_in_flight_or_stuck_keep_the_store_within_its_bytes(env) -> None:
    """The bytes an eviction can free are the LRU's own: victims whose index delete is still on
    its way (another insert runs meanwhile) or failed (Redis away: the slot stays pinned) stay
    counted as pinned and are not freed twice, so an insert that cannot fit is refused, never
    over the bound, and once the deletes succeed again the stuck slots are freed."""
    _, _, index, (a, _, _) = env
    store = EmbeddingStore(a, index, capacity_bytes=3 * 512, max_item_fraction=0.4)
    real_delete, gate, failing = index.delete, asyncio.Event(), False

    async def delete(key, gen):
        await gate.wait()
        return False if failing else await real_delete(key, gen)

    def lru_bytes() -> int:
        assert store._lru_bytes == sum(c.ref.nbytes for c in store._lru.values())
        return store._lru_bytes

    async def insert(key: str, i: int):
        return await store.insert(key, a.put(emb(i)), (1, 4, 4), 4)

    index.delete = delete
    try:
        for i in range(3):
            assert await insert(f"k{i}", i) is not None
        # two inserts at once while the deletes are held: the second finds the first's victim
        # still pinned and evicts two more to stay within the bound
        inserts = [asyncio.create_task(insert(f"n{i}", 10 + i)) for i in range(2)]
        await asyncio.sleep(0.05)
        assert len(store) == 2 and lru_bytes() == 2 * 512 and store.bytes == 5 * 512
        gate.set()
        assert all(c is not None for c in await asyncio.gather(*inserts))
        assert store.bytes == 2 * 512 == lru_bytes()
        # deletes fail (Redis away): victims stay pinned and counted
        failing = True
        assert await insert("m0", 20) is not None and store.bytes == 3 * 512  # fits, no eviction
        assert await insert("m1", 21) is not None  # evicts n0: stuck
        assert store.bytes == 4 * 512 and lru_bytes() == 3 * 512 and len(store._stuck) == 1
        assert await insert("m2", 22) is not None  # evicts n1 and m0: stuck too
        assert store.bytes == 5 * 512 and lru_bytes() == 2 * 512 and len(store._stuck) == 3
        assert await insert("m3", 23) is None  # 3 stuck + 2 cached: the bound refuses it
        assert store.bytes == 5 * 512
        failing = False  # Redis back: the next insert retires the stuck ones first
        assert await insert("m4", 24) is not None
        assert store.bytes == 3 * 512 == lru_bytes() and not store._stuck and len(store) == 3
    finally:
        index.delete = real_delete
        await store.close()


async def test_forty_concurrent_requests_over_two_workers_encode_once(env) -> None:
    _, _, index, (a, b, _) = env
    (ca, _), (cb, _) = make_cache(index, a), make_cache(index, b)
    enc_a, enc_b = CountingEncoder(a), CountingEncoder(b)
    key = cache_key("fp", "same-image")
    calls = [ca.embed(pixel_item(key), enc_a(7), fleet_ok=True, deadline_unix_ms=2**62) for _ in range(20)]
    calls += [cb.embed(pixel_item(key), enc_b(7), fleet_ok=True, deadline_unix_ms=2**62) for _ in range(20)]
    results = await asyncio.gather(*calls)
    assert enc_a.calls + enc_b.calls == 1
    owner = a if enc_a.calls else b
    assert {o.name for o, _ in results} == {owner.name}
    assert len({(it.embeds.addr, it.cache_key) for _, it in results}) == 1
    # the content every request gets is the one embedding
    for o, it in results[:3] + results[-3:]:
        got = await (a if o.name == a.name else b).get(o, it.embeds)
        assert torch.equal(got, emb(7))


async def test_a_holder_finishing_right_after_a_poll_is_a_hit_not_a_second_encode(env) -> None:
    """The waiter reads the entry and takes a free lease in one atomic step: a holder that
    publishes and releases just after a poll is seen as its entry at the next poll, never as a
    lease free for the taking (which would encode the item a second time)."""
    _, _, index, (a, b, _) = env
    key = cache_key("fp", "race")
    assert (await index.lookup_or_lease(key, "enc0#1"))[1]  # worker a holds the lease, encoding
    entry = protocol.EmbeddingIndexEntry(owner=a.ref(), embeds=a.put(emb(9)), grid_thw=(1, 4, 4), n_tokens=EMB[0],
                                         gen=1, created_unix_ms=1)
    reads = 0
    read = index.lookup_or_lease

    async def holder_finishes_after_the_first_poll(k: str, holder: str):
        nonlocal reads
        got = await read(k, holder)
        reads += 1
        if reads == 2:  # b's miss, then its first poll: a publishes and releases right behind it
            await index.finish_encode(key, entry, "enc0#1", 1)
        return got

    index.lookup_or_lease = holder_finishes_after_the_first_poll
    cache, _ = make_cache(index, b)
    enc = CountingEncoder(b, delay_s=0)
    owner, item = await cache.embed(pixel_item(key), enc(9), fleet_ok=True, deadline_unix_ms=2**62)
    assert enc.calls == 0 and reads == 3
    assert owner.name == a.name and item.embeds == entry.embeds


async def test_redis_away_means_encoding_at_once_not_waiting(env) -> None:
    """With Redis unreachable nobody's lease can be seen: the item is encoded at once
    (uncoordinated), not after the coalescing wait (15 s by default; a minute here)."""
    _, keys, _, (a, _, _) = env
    away = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)  # nothing listens there
    try:
        index = EmbeddingIndex(away, keys, ttl_s=60, lease_ms=400)
        cache, _ = make_cache(index, a, wait_ms=60_000)
        enc = CountingEncoder(a, delay_s=0)
        t0 = time.monotonic()
        owner, item = await cache.embed(pixel_item(cache_key("fp", "no-redis")), enc(4), fleet_ok=True,
                                        deadline_unix_ms=2**62)
        await cache.drain()
        assert enc.calls == 1 and owner.name == a.name and time.monotonic() - t0 < 10
    finally:
        await away.aclose()


async def test_a_dead_lease_holder_is_taken_over_after_expiry(env) -> None:
    _, _, index, (a, _, _) = env
    cache, _ = make_cache(index, a)
    key = cache_key("fp", "orphan")
    assert (await index.lookup_or_lease(key, "ghost-worker"))[1]  # a holder that will never publish
    enc = CountingEncoder(a, delay_s=0)
    owner, item = await cache.embed(pixel_item(key), enc(3), fleet_ok=True, deadline_unix_ms=2**62)
    assert enc.calls == 1 and owner.name == a.name and item.embeds.lease != 0
    await cache.drain()
    assert (await index.lookup(key)) is not None


async def test_prefill_validates_lease_less_refs_and_falls_back(env) -> None:
    redis, keys, index, (a, _, p) = env
    cache, store = make_cache(index, a, capacity=512, wait_ms=1_000, fraction=1.0)
    ctx = Context(stage="prefill", worker_id=p.name, events=ListSink(), transfer=p)
    puller = EmbeddingPuller(index, RecentEmbeddings(1 << 16))
    enc = CountingEncoder(a, delay_s=0)
    k1, k2 = cache_key("fp", "one"), cache_key("fp", "two")
    await cache.embed(pixel_item(k1), enc(1), fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()
    entry = await index.lookup_live(k1)
    hit = protocol.EmbeddingItem(index=0, mm_hash="one", grid_thw=(1, 4, 4), n_tokens=4, embeds=entry.embeds,
                                 cache_key=k1, cache_gen=entry.gen)
    msg = protocol.PrefillRequest(meta=_meta(), owners=(entry.owner,), items=(hit,))
    [(got, *_)] = await EmbeddingPuller(index).pull(msg, ctx)
    assert torch.equal(got, emb(1))
    # k2 evicts k1 (capacity one item): the same ref no longer validates -> restart, not garbage
    await cache.embed(pixel_item(k2), enc(2), fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()
    with pytest.raises(OwnerGoneError):
        await puller.pull(msg, ctx)
    # a copy prefill already holds needs no pull and no owner
    entry2 = await index.lookup_live(k2)
    hit2 = protocol.EmbeddingItem(index=0, mm_hash="two", grid_thw=(1, 4, 4), n_tokens=4, embeds=entry2.embeds,
                                  cache_key=k2, cache_gen=entry2.gen)
    msg2 = protocol.PrefillRequest(meta=_meta(), owners=(entry2.owner,), items=(hit2,))
    await puller.pull(msg2, ctx)
    await store.close()  # the owner's entries and slots are gone now
    [(got2, *_)] = await puller.pull(msg2, ctx)
    assert torch.equal(got2, emb(2))


async def test_dead_owner_entries_are_not_used_and_are_dropped(env) -> None:
    redis, keys, index, (a, _, _) = env
    cache, _ = make_cache(index, a)
    key = cache_key("fp", "dead-owner")
    await cache.embed(pixel_item(key), CountingEncoder(a, 0)(5), fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()
    await redis.delete(keys.alive(a.name))  # the owner's process is gone
    assert await index.lookup_live(key) is None
    assert await index.lookup(key) is None  # dropped for everyone


async def test_an_owner_between_partitions_keeps_its_entries(env) -> None:
    """A rebalance leaves a live owner without partitions (and without its ``worker`` record)
    for seconds: its entries stay usable, since its pool still serves reads."""
    redis, keys, index, (a, _, _) = env
    cache, _ = make_cache(index, a)
    key = cache_key("fp", "rebalancing-owner")
    await cache.embed(pixel_item(key), CountingEncoder(a, 0)(5), fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()
    assert await redis.exists(keys.worker(a.name)) == 0  # no partitions held (never had any here)
    assert (await index.lookup_live(key)).owner.name == a.name
    entry, leased = await index.lookup_or_lease(key, "someone")
    assert entry is not None and entry.owner.name == a.name and not leased


async def test_redis_flushed_only_costs_misses(env) -> None:
    redis, _, index, (a, b, _) = env
    (ca, _), (cb, _) = make_cache(index, a), make_cache(index, b)
    key = cache_key("fp", "flush")
    enc = CountingEncoder(a, 0)
    await ca.embed(pixel_item(key), enc(9), fleet_ok=True, deadline_unix_ms=2**62)
    await ca.drain()
    await redis.flushall()
    assert await index.lookup_live(key) is None
    enc_b = CountingEncoder(b, 0)
    owner, item = await cb.embed(pixel_item(key), enc_b(9), fleet_ok=True, deadline_unix_ms=2**62)
    assert enc_b.calls == 1 and owner.name == b.name  # a miss, encoded again, no error
    owner, item = await ca.embed(pixel_item(key), enc(9), fleet_ok=True, deadline_unix_ms=2**62)
    assert enc.calls == 1 and owner.name == a.name and item.embeds.lease  # worker a's own copy


def _meta() -> protocol.RequestMeta:
    return protocol.RequestMeta(request_id=uuid.uuid4().hex, model="m", deadline_unix_ms=2**62,
                                created_unix_ms=0, prompt_token_ids=(1,))


async def test_finish_encode_publishes_then_releases_only_its_own_lease_then_counts(env) -> None:
    redis, keys, index, (a, _, _) = env
    key = cache_key("fp", "finish")
    entry = protocol.EmbeddingIndexEntry(owner=a.ref(), embeds=a.put(emb(5)), grid_thw=(1, 4, 4), n_tokens=EMB[0],
                                         gen=7, created_unix_ms=1)
    assert (await index.lookup_or_lease(key, "other#1"))[1]
    assert await index.finish_encode(key, entry, "mine#1", 1)  # a lease that is not ours stays
    assert await redis.exists(keys.embedding_lease(key))
    assert (await index.lookup(key)) == entry and await index.still_valid(key, 7)
    assert 0 < await redis.ttl(keys.embedding_index(key)) <= index.ttl_s
    assert int(await redis.get(keys.encoder_items())) == 1
    await redis.delete(keys.embedding_lease(key))
    assert await redis.set(keys.embedding_lease(key), "mine#2", nx=True, px=index.lease_ms)  # beside the entry
    assert not await index.finish_encode(key, None, "mine#2", 0)  # only the release: no entry written
    assert not await redis.exists(keys.embedding_lease(key))
    assert int(await redis.get(keys.encoder_items())) == 1
    await redis.script_flush()  # a Redis that lost its scripts (restart, SCRIPT FLUSH): loaded again
    assert await index.finish_encode(key, entry, None, 2)
    assert int(await redis.get(keys.encoder_items())) == 3


async def test_a_lease_media_fetch_took_is_used_without_a_round_trip_and_freed_when_not_needed(env) -> None:
    """``PixelItem.lease_holder``: media-fetch took the encode lease in its own index round trip.
    Encode then starts without one (no ``lookup_or_lease``) and releases the lease after
    publishing. An item whose key this worker is already working on (a request without the
    lease got there first and waits for the holder) frees its lease at once: the waiter takes it
    over at its next poll instead of waiting out the coalescing bound."""
    import msgspec

    redis, keys, index, (a, _, _) = env
    rounds = 0
    real = index.lookup_or_lease

    async def counting(k: str, holder: str):
        nonlocal rounds
        rounds += 1
        return await real(k, holder)

    index.lookup_or_lease = counting
    cache, _ = make_cache(index, a, wait_ms=60_000)
    enc = CountingEncoder(a, delay_s=0)
    key = cache_key("fp", "pre-leased")
    assert (await real(key, "mf#m1"))[1]  # media-fetch's round trip: a miss, the lease taken
    owner, item = await cache.embed(msgspec.structs.replace(pixel_item(key), lease_holder="mf#m1"), enc(5),
                                    fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()
    assert rounds == 0 and enc.calls == 1 and owner.name == a.name
    assert await redis.get(keys.embedding_lease(key)) is None and (await index.lookup(key)) is not None

    late = cache_key("fp", "lease-holder-second")
    assert (await real(late, "mf#m2"))[1]
    waiter = asyncio.ensure_future(cache.embed(pixel_item(late), enc(6), fleet_ok=True, deadline_unix_ms=2**62))
    await asyncio.sleep(0.05)  # no lease for it: it polls for the holder's entry
    t0 = time.monotonic()
    holder = await cache.embed(msgspec.structs.replace(pixel_item(late), lease_holder="mf#m2"), enc(6),
                               fleet_ok=True, deadline_unix_ms=2**62)
    got = await waiter
    await cache.drain()
    # taken over at the next 5 ms poll and encoded once: not when the lease expires (400 ms here)
    assert time.monotonic() - t0 < 0.25 and enc.calls == 2
    assert got[1].embeds.addr == holder[1].embeds.addr
    assert await redis.get(keys.embedding_lease(late)) is None
