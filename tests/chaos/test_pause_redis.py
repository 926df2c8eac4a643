"""Chaos: Redis stops answering (SIGSTOP, then SIGCONT 31 s later) in the middle of a streaming
load. Nothing may crash: every worker of the fleet is the same process after the stall, every
request ends with the exact reference text or an explicit 503 (never a 500, never a hang), and
requests after the stall are served normally."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import pytest

from tests import procs
from tests.chaos.load import PROMPTS, TIMEOUT_MS, load_with_fault, reference_texts

REQUESTS = 24
STALL_S = 31.0


def _worker_pids(supervisor_pid: int) -> set[int]:
    return {pid for pid in procs.children_of(supervisor_pid) if "--stages" in procs.argv_of(pid)}


async def _stall_mid_load(redis_pid: int, tasks: list[asyncio.Task]) -> int:
    """SIGSTOP Redis for ``STALL_S`` with the load in full swing; returns how many requests
    were unfinished when it stopped."""
    while sum(t.done() for t in tasks) < REQUESTS // 3:
        await asyncio.sleep(0.02)
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        unfinished = REQUESTS - sum(t.done() for t in tasks)
        await asyncio.sleep(STALL_S)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    return unfinished


@pytest.fixture(scope="module")
def references(model_dir):
    return reference_texts(model_dir)


def test_redis_paused_mid_load(kafka_bootstrap, logs_dir, model_dir, references):
    pids: list[int] = []
    with procs.redis_server(logs_dir, pids=pids) as own_redis:  # paused: never the session's Redis
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": own_redis, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS), "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024)}
        log_dir = logs_dir / "pause-redis"
        log_dir.mkdir()
        try:
            with procs.fleet(env, log_dir, mode="e-p-d") as (base, supervisor):
                workers = _worker_pids(supervisor.pid)
                results, in_flight, after = asyncio.run(load_with_fault(
                    base, REQUESTS, 4, lambda tasks: _stall_mid_load(pids[0], tasks)))
                still = _worker_pids(supervisor.pid)
        finally:
            os.kill(pids[0], signal.SIGCONT)  # whatever happened above: never leave it stopped
    outcomes = Counter(kind for _, kind, _ in results)
    print(f"\nredis paused {STALL_S:.0f} s: {REQUESTS} requests, {in_flight} unfinished at the pause, "
          f"outcomes {dict(outcomes)}")
    assert len(workers) >= 3 and still == workers, "a worker exited (or was restarted) during the stall"
    assert len(results) == REQUESTS  # none hung
    assert set(outcomes) <= {"completed", "error 503", "error event"}, outcomes  # never a 500
    wrong = [(i, t) for i, kind, t in results if kind == "completed" and t != references[i % len(PROMPTS)]]
    assert not wrong, wrong[:3]
    assert all("503" in t or "unavailable" in t for _, kind, t in results if kind == "error event"), results
    assert [kind for _, kind, _ in after] == ["completed"] * len(PROMPTS)
    assert [t for _, _, t in after] == references
