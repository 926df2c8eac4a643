"""The ledger's one-round-trip entry and exit against real Redis: ``enter`` answers aborted /
done / claimed / held exactly as the three separate calls did, and ``finish`` marks done and
releases only a claim that is still ours; a claim's keeper refreshes it only once a third of a
lease has passed, and a short record's keeper leaves nothing running."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.keys import RedisKeys
from shared.transport.ledger import ABORTED, CLAIMED, DONE, HELD, StageLedger


async def test_enter_and_finish(redis_url):
    redis = aioredis.from_url(redis_url)
    ledger = StageLedger(redis, RedisKeys(f"t{uuid.uuid4().hex[:8]}"), lease_ms=5_000, done_ttl_s=60)
    try:
        assert await ledger.enter("r1", "encode", 0, "w1") == CLAIMED
        assert await ledger.enter("r1", "encode", 0, "w2") == HELD  # w1's live claim
        assert await ledger.enter("r1", "encode", 1, "w2") == CLAIMED  # another attempt is another key
        await ledger.finish("r1", "encode", 0, "w1")
        assert await ledger.is_done("r1", "encode", 0)
        assert await ledger.enter("r1", "encode", 0, "w2") == DONE
        # finish by a worker whose claim lapsed and was taken: marks done, leaves the other's claim
        assert await ledger.enter("r2", "prefill", 0, "w1") == CLAIMED
        await ledger.finish("r2", "prefill", 0, "w9")
        assert await ledger.is_done("r2", "prefill", 0)
        assert await ledger.refresh("r2", "prefill", 0, "w1")  # still w1's
        await ledger.abort("r3", ttl_s=60)
        assert await ledger.enter("r3", "decode", 0, "w1") == ABORTED
        assert await ledger.enter("r3", "decode", 0, "w1") == ABORTED
    finally:
        await redis.aclose()


async def test_a_keeper_refreshes_a_long_claim_and_a_short_one_costs_no_task(redis_url):
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    ledger = StageLedger(redis, keys, lease_ms=600, done_ttl_s=60)
    claim = keys.lease("r1", "encode#0")
    try:
        tasks = len(asyncio.all_tasks())
        assert await ledger.enter("r1", "encode", 0, "w1") == CLAIMED
        short = ledger.keeper("r1", "encode", 0, "w1")
        assert len(asyncio.all_tasks()) == tasks and not short.started  # a timer, no task
        await short.stop()
        await asyncio.sleep(0.3)  # past a third of the lease: a keeper would have started
        assert not short.started and len(asyncio.all_tasks()) == tasks
        long = ledger.keeper("r1", "encode", 0, "w1")
        await asyncio.sleep(1.0)  # well past the 600 ms lease: kept alive by the refreshes
        assert long.started
        assert await redis.get(claim) == b"w1" and await redis.pttl(claim) > 200
        await long.stop()
        assert len(asyncio.all_tasks()) == tasks
        await asyncio.sleep(0.8)  # nobody refreshes it now: it lapses
        assert await redis.get(claim) is None
    finally:
        await redis.aclose()
