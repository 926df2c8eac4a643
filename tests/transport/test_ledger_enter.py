"""The ledger's one-round-trip entry and exit against real Redis: ``enter`` answers aborted /
done / claimed / held exactly as the three separate calls did, and ``finish`` marks done and
releases only a claim that is still ours."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from shared.keys import RedisKeys
from shared.ledger import ABORTED, CLAIMED, DONE, HELD, StageLedger


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
