"""Chaos: Redis flushed (FLUSHALL) in the middle of a streaming load. Token logs, stage claims
and liveness records vanish; the service must go on: every request ends (completion with the
exact reference text, or an explicit error) within its deadline, and requests after the flush
are served normally."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis

from tests import procs
from tests.chaos.load import PROMPTS, TIMEOUT_MS, load_with_fault, reference_texts

REQUESTS = 24


async def _flush_mid_load(redis_url: str, tasks: list[asyncio.Task]) -> int:
    """FLUSHALL with the load in full swing; returns how many requests were unfinished then."""
    while sum(t.done() for t in tasks) < REQUESTS // 3:
        await asyncio.sleep(0.02)
    r = redis.Redis.from_url(redis_url)
    try:
        r.flushall()
    finally:
        r.close()
    return REQUESTS - sum(t.done() for t in tasks)


@pytest.fixture(scope="module")
def references(model_dir):
    return reference_texts(model_dir)


def test_redis_flush_mid_load(kafka_bootstrap, logs_dir, model_dir, references):
    with procs.redis_server(logs_dir) as own_redis:  # FLUSHALL must not hit the session's Redis
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": own_redis, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS), "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024)}
        log_dir = logs_dir / "flush"
        log_dir.mkdir()
        with procs.fleet(env, log_dir, mode="e-p-d") as (base, _supervisor):
            results, in_flight, after = asyncio.run(load_with_fault(
                base, REQUESTS, 4, lambda tasks: _flush_mid_load(own_redis, tasks)))
    outcomes = Counter(kind for _, kind, _ in results)
    print(f"\nredis flush: {REQUESTS} requests, {in_flight} not finished at the flush, outcomes {dict(outcomes)}")
    assert in_flight > 0
    assert len(results) == REQUESTS  # none hung
    wrong = [(i, t) for i, kind, t in results if kind == "completed" and t != references[i % len(PROMPTS)]]
    assert not wrong, wrong[:3]
    assert [kind for _, kind, _ in after] == ["completed"] * len(PROMPTS)
    assert [t for _, _, t in after] == references
