"""Chaos: the broker is killed (``kill -9``) mid-load and restarted by ``mmfleet up``.

The embedded broker keeps records and committed offsets in memory only, yet every stream shows
each token once: the supervisor records the restart (a fresh broker-epoch token in Redis), the
gateway re-drives each request it is still answering under a fresh attempt, stages redo it and
decode resumes from the token log. Requests arriving while the broker is down wait for it
(``queue_retry_ms``). Then the broker is killed twice more with the fleet idle and a request
arriving at once: an offset commit decided before the restart must not land on the new broker,
and records produced before its topics exist must not be hidden by it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from services import embedded_broker
from tests import procs
from tests.chaos.load import PROMPTS, TIMEOUT_MS, load_with_fault, one, reference_texts

REQUESTS = int(os.environ.get("CHAOS_REQUESTS", "48"))
CONCURRENCY = 6


def _broker_pid(supervisor_pid: int) -> int | None:
    for pid in procs.children_of(supervisor_pid):
        argv = procs.argv_of(pid)
        if argv and "tansu" in os.path.basename(argv[0]) and "broker" in argv:
            return pid
    return None


async def _kill_broker(supervisor_pid: int) -> int | None:
    await asyncio.sleep(4)  # work streams through every stage
    killed = _broker_pid(supervisor_pid)
    if killed is not None:
        os.kill(killed, signal.SIGKILL)
    return killed


async def _idle_kills(base: str, supervisor_pid: int, rounds: int) -> list[list[str]]:
    """``rounds`` times: kill the broker of an idle fleet, then at once one request of each
    prompt, one after another; their texts (or errors)."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                timeout=TIMEOUT_MS / 1000 + 30)
    texts = []
    try:
        for _ in range(rounds):
            os.kill(_broker_pid(supervisor_pid), signal.SIGKILL)
            texts.append([(await one(client, i))[2] for i in range(len(PROMPTS))])
    finally:
        await client.close()
    return texts


@pytest.fixture(scope="module")
def references(model_dir):
    return reference_texts(model_dir)


def test_broker_killed_and_restarted_under_load(redis_url, model_dir, logs_dir, references):
    # no broker answers on this port: `mmfleet up` starts (and restarts) its own tansu there
    env = {"KAFKA_BOOTSTRAP": f"127.0.0.1:{procs.free_port()}", "REDIS_URL": redis_url,
           "MMFLEET_MODEL_PATH": str(model_dir), "MMFLEET_REDIS_PREFIX": "chaos-broker",
           "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS), "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
           "MMFLEET_STAGE_LEASE_MS": "6000"}
    log_dir = logs_dir / "chaos-broker"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode="e-p-d") as (base, supervisor):
        t0 = time.monotonic()
        results, killed, after = asyncio.run(load_with_fault(
            base, REQUESTS, CONCURRENCY, lambda _tasks: _kill_broker(supervisor.pid)))
        elapsed = time.monotonic() - t0
        restarted = _broker_pid(supervisor.pid)
        # the broker `mmfleet up` started again runs with the first one's setting: one runtime worker
        restarted_env = Path(f"/proc/{restarted}/environ").read_bytes().split(b"\0") if restarted else []
        idle = asyncio.run(_idle_kills(base, supervisor.pid, rounds=3))
    outcomes = Counter(kind for _, kind, _ in results)
    wrong = [(i, text) for i, kind, text in results if kind == "completed" and text != references[i % len(PROMPTS)]]
    redriven = sum(p.read_text().count("re-driving") for p in log_dir.glob("gateway*.log"))
    print(f"\nbroker chaos: {REQUESTS} requests in {elapsed:.1f} s, broker pid {killed} -> {restarted}, "
          f"outcomes {dict(outcomes)}, gateway re-drives {redriven}")
    for i, kind, text in results:
        if kind != "completed":
            print(f"  request {i}: {kind}: {text[:300]}")
    assert killed is not None and restarted is not None and restarted != killed, "the broker was restarted"
    assert f"TOKIO_WORKER_THREADS={embedded_broker.THREADS}".encode() in restarted_env
    assert len(results) == REQUESTS  # none hung past its deadline
    assert not wrong, f"{len(wrong)} completed streams differ from the reference: {wrong[:3]}"
    assert redriven >= 1, "the gateway noticed the restart and re-drove its unfinished requests"
    assert outcomes["completed"] >= REQUESTS * 0.9, outcomes
    assert [t for _, _, t in after] == references  # and the service goes on
    assert idle == [references] * 3  # a restart of an idle fleet loses nothing either
