"""Chaos: under a steady streaming load, ``kill -9`` one worker of each stage in turn (the
supervisor restarts it). Every request must end in a completion whose text is exactly the
temperature-0 reference (no token lost or duplicated) or in an explicit terminal error, within
its deadline; none may hang. ``make chaos`` runs the long version (CHAOS_REQUESTS=200)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import pytest

from services.modes import MODES
from tests import procs
from tests.chaos.load import PROMPTS, TIMEOUT_MS, load_with_fault, reference_texts

REQUESTS = int(os.environ.get("CHAOS_REQUESTS", "48"))
CONCURRENCY = 6
VLLM_TIMEOUT_MS = 240_000  # above two vLLM engines' restart at once on 2 shared cores


def _stage_pids(supervisor_pid: int) -> dict[str, int]:
    out = {}
    for pid in procs.children_of(supervisor_pid):
        argv = procs.argv_of(pid)
        if "--stages" in argv:
            out[argv[argv.index("--stages") + 1]] = pid
    return out


# each worker of the default layout by its --stages, downstream first: a stage is killed while
# work streams through it (killing the entry first would stall everything behind it, and the
# later kills would find idle workers)
KILL_ORDER = [",".join(group) for group in reversed(MODES["e-p-d"])]


async def _kill_each_stage(supervisor_pid: int) -> list[str]:
    killed = []
    for stage in KILL_ORDER:
        await asyncio.sleep(3)
        pid = _stage_pids(supervisor_pid).get(stage)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(stage)
    return killed


@pytest.fixture(scope="module")
def references(model_dir):
    return reference_texts(model_dir)


def test_kill_each_stage_worker_under_load(kafka_bootstrap, redis_url, model_dir, logs_dir, references):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_REDIS_PREFIX": "chaos", "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_STAGE_LEASE_MS": "6000"}
    log_dir = logs_dir / "chaos"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode="e-p-d") as (base, supervisor):
        before = _stage_pids(supervisor.pid)
        t0 = time.monotonic()
        results, killed, after = asyncio.run(load_with_fault(
            base, REQUESTS, CONCURRENCY, lambda _tasks: _kill_each_stage(supervisor.pid)))
        elapsed = time.monotonic() - t0
        pids_after = _stage_pids(supervisor.pid)
    outcomes = Counter(kind for _, kind, _ in results)
    wrong = [(i, text) for i, kind, text in results if kind == "completed" and text != references[i % len(PROMPTS)]]
    resumed = sum(p.read_text().count("resuming after them") for p in log_dir.glob("*.log"))
    restarted = sum(p.read_text().count("restarting it from its source") for p in log_dir.glob("*.log"))
    print(f"\nchaos: {REQUESTS} requests in {elapsed:.1f} s, killed {killed}, outcomes {dict(outcomes)}, "
          f"decodes resumed from the token log {resumed}, restarts from the source {restarted}")
    assert killed == KILL_ORDER
    assert all(pids_after[s] != before[s] for s in killed), "every killed worker was restarted"
    assert len(results) == REQUESTS  # none hung past its deadline
    assert not wrong, f"{len(wrong)} completed streams differ from the reference: {wrong[:3]}"
    assert outcomes["completed"] >= REQUESTS * 0.9, outcomes
    assert [t for _, _, t in after] == references  # and the service goes on


def check_vllm_kills(base: str, supervisor_pid: int, references: list[str], requests: int = 24) -> None:
    """e-p-d on vLLM (run by tests/e2e/test_modes.py on its e-p-d vLLM fleet, which sets
    ``VLLM_FLEET_ENV``): the KV lives in the prefill worker's engine until decode's engine reads
    it. Killing decode (its reads half done, its streams half written) and then prefill
    (holding KV not yet read) loses and duplicates nothing: decode resumes from the token log
    under a fresh attempt, a read from a dead producer restarts the request from its source.
    A killed vLLM worker's engine takes up to a minute to start again on 2 shared cores (two at
    once here), so that fleet's request deadline is ``VLLM_TIMEOUT_MS``: none may fail."""

    async def kill_decode_then_prefill(_tasks) -> list[str]:
        killed = []
        for stage in ("decode", "prefill"):
            await asyncio.sleep(3)
            pid = _stage_pids(supervisor_pid).get(stage)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(stage)
        return killed

    before = _stage_pids(supervisor_pid)
    results, killed, after = asyncio.run(load_with_fault(base, requests, CONCURRENCY, kill_decode_then_prefill,
                                                         timeout_ms=VLLM_TIMEOUT_MS))
    pids_after = _stage_pids(supervisor_pid)
    outcomes = Counter(kind for _, kind, _ in results)
    wrong = [(i, text) for i, kind, text in results if kind == "completed" and text != references[i % len(PROMPTS)]]
    print(f"\nchaos (vllm): {requests} requests, killed {killed}, outcomes {dict(outcomes)}")
    assert killed == ["decode", "prefill"]
    assert all(pids_after[s] != before[s] for s in killed), "every killed worker was restarted"
    assert len(results) == requests
    assert not wrong, f"{len(wrong)} completed streams differ from the reference: {wrong[:3]}"
    assert outcomes["completed"] == requests, outcomes  # the deadline outlives the restarts: none may fail
    assert [t for _, _, t in after] == references


VLLM_FLEET_ENV = {"MMFLEET_REQUEST_TIMEOUT_MS": str(VLLM_TIMEOUT_MS), "MMFLEET_STAGE_LEASE_MS": "6000"}
