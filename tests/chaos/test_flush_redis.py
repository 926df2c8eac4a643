"""Chaos: Redis flushed (FLUSHALL) in the middle of a streaming load. Token logs, stage claims
and liveness records vanish; the service must go on: every request ends (completion with the
exact reference text, or an explicit error) within its deadline, and requests after the flush
are served normally."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import redis

from tests import procs
from tests.chaos.test_kill_workers import MAX_TOKENS, PROMPTS, TIMEOUT_MS, _one, references  # noqa: F401

REQUESTS = 24


async def _load_with_flush(base: str, redis_url: str) -> list:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                timeout=TIMEOUT_MS / 1000 + 30)
    sem = asyncio.Semaphore(4)

    async def guarded(i: int):
        async with sem:
            return await _one(client, i)

    tasks = [asyncio.create_task(guarded(i)) for i in range(REQUESTS)]
    while sum(t.done() for t in tasks) < REQUESTS // 3:  # flush with the load in full swing
        await asyncio.sleep(0.02)
    r = redis.Redis.from_url(redis_url)
    try:
        r.flushall()
    finally:
        r.close()
    in_flight_at_flush = REQUESTS - sum(t.done() for t in tasks)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=TIMEOUT_MS / 1000 * 2)
    after = [await _one(client, i) for i in range(len(PROMPTS))]  # service after the flush
    await client.close()
    return results, after, in_flight_at_flush


def test_redis_flush_mid_load(kafka_bootstrap, logs_dir, model_dir, references):
    with procs.redis_server(logs_dir) as own_redis:  # FLUSHALL must not hit the session's Redis
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": own_redis, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS), "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024)}
        log_dir = logs_dir / "flush"
        log_dir.mkdir()
        with procs.fleet(env, log_dir, mode="e-p-d") as (base, _supervisor):
            results, after, in_flight = asyncio.run(_load_with_flush(base, own_redis))
    outcomes = Counter(kind for _, kind, _ in results)
    print(f"\nredis flush: {REQUESTS} requests, {in_flight} not finished at the flush, outcomes {dict(outcomes)}")
    assert in_flight > 0
    assert len(results) == REQUESTS  # none hung
    wrong = [(i, t) for i, kind, t in results if kind == "completed" and t != references[i % len(PROMPTS)]]
    assert not wrong, wrong[:3]
    assert [kind for _, kind, _ in after] == ["completed"] * len(PROMPTS)
    assert [t for _, _, t in after] == references
