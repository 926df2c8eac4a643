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
from pathlib import Path

import openai
import pytest

from tests import procs
from tests.e2e.test_skeleton import gradient_image, noise_image, png_data_url, ref_parts, reference_text

REQUESTS = int(os.environ.get("CHAOS_REQUESTS", "48"))
CONCURRENCY = 6
MAX_TOKENS = 24
TIMEOUT_MS = 90_000
PROMPTS = [
    ([], "Tell me a story about the sea."),
    ([noise_image(21)], "Describe what you see."),
    ([], "List three colours."),
    ([gradient_image()], "What is in the picture?"),
]


def _stage_pids(supervisor_pid: int) -> dict[str, int]:
    out = {}
    for pid in procs.children_of(supervisor_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--stages" in argv:
            out[argv[argv.index(b"--stages") + 1].decode()] = pid
    return out


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str]:
    imgs, text = PROMPTS[i % len(PROMPTS)]
    content = text if not imgs else [*({"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in imgs),
                                     {"type": "text", "text": text}]
    pieces = []
    try:
        stream = await client.chat.completions.create(
            model="mmfleet-demo", stream=True, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": content}])
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
        return i, "completed", "".join(pieces)
    except openai.APIStatusError as exc:
        return i, f"error {exc.status_code}", str(exc)
    except openai.APIError as exc:  # an SSE error event after the first token
        return i, "error event", str(exc)


async def _load_with_kills(base: str, supervisor_pid: int) -> tuple[list, list[str]]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                timeout=TIMEOUT_MS / 1000 + 30)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def guarded(i: int):
        async with sem:
            return await _one(client, i)

    tasks = [asyncio.create_task(guarded(i)) for i in range(REQUESTS)]
    killed = []
    # downstream first: a stage is killed while work streams through it (killing media-fetch
    # first would stall everything behind it, and the later kills would find idle workers)
    for stage in ("decode", "prefill", "encode", "media-fetch"):
        await asyncio.sleep(3)
        pid = _stage_pids(supervisor_pid).get(stage)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(stage)
    done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=TIMEOUT_MS / 1000 * 3)
    await client.close()
    return done, killed


@pytest.fixture(scope="module")
def references(model_dir):
    return [reference_text(model_dir, ref_parts(len(imgs), text) if imgs else text, imgs, max_tokens=MAX_TOKENS)
            for imgs, text in PROMPTS]


def test_kill_each_stage_worker_under_load(kafka_bootstrap, redis_url, model_dir, logs_dir, references):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_REDIS_PREFIX": "chaos", "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_STAGE_LEASE_MS": "6000"}
    log_dir = logs_dir / "chaos"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode="e-p-d") as (base, supervisor):
        before = _stage_pids(supervisor.pid)
        t0 = time.monotonic()
        results, killed = asyncio.run(_load_with_kills(base, supervisor.pid))
        elapsed = time.monotonic() - t0
        after = _stage_pids(supervisor.pid)
    outcomes = Counter(kind for _, kind, _ in results)
    wrong = [(i, text) for i, kind, text in results if kind == "completed" and text != references[i % len(PROMPTS)]]
    resumed = sum(p.read_text().count("resuming after them") for p in log_dir.glob("*.log"))
    restarted = sum(p.read_text().count("restarting it from its source") for p in log_dir.glob("*.log"))
    print(f"\nchaos: {REQUESTS} requests in {elapsed:.1f} s, killed {killed}, outcomes {dict(outcomes)}, "
          f"decodes resumed from the token log {resumed}, restarts from the source {restarted}")
    assert killed == ["decode", "prefill", "encode", "media-fetch"]
    assert all(after[s] != before[s] for s in killed), "every killed worker was restarted"
    assert len(results) == REQUESTS  # none hung past its deadline
    assert not wrong, f"{len(wrong)} completed streams differ from the reference: {wrong[:3]}"
    assert outcomes["completed"] >= REQUESTS * 0.9, outcomes
