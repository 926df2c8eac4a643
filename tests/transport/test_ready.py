"""``GET /ready`` against a real broker and redis-server, the gateway app in this process: 503
naming every stage on a request's path that no live worker serves (from the workers' liveness
records, whatever the mode's grouping), 200 once a request of each kind could be answered, 503
again when a worker's record goes. ``/health`` answers 200 throughout."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp

from services.gateway.readiness import request_paths
from shared import protocol
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.transport.liveness import heartbeat
from shared.transport.redis_conn import make_redis
from tests import procs


async def _ready(http: aiohttp.ClientSession, base: str) -> tuple[int, dict]:
    async with http.get(base + "/ready") as resp:
        return resp.status, await resp.json()


async def _until(http, base, status: int, timeout_s: float = 10) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got, body = await _ready(http, base)
        if got == status or loop.time() > deadline:
            assert got == status, body
            return body
        await asyncio.sleep(0.05)


def _worker(stages: tuple[str, ...]) -> protocol.WorkerInfo:
    return protocol.WorkerInfo(worker_id=f"w-{uuid.uuid4().hex[:6]}", stages=stages, pid=1, host="127.0.0.1",
                               started_unix_ms=0)


def test_the_paths_follow_the_stage_order_from_where_a_request_enters():
    assert request_paths(frozenset()) == {"text-only requests": ("prefill", "decode")}
    assert request_paths(frozenset({"image"})) == {
        "text-only requests": ("prefill", "decode"),
        "requests with media": ("media-fetch", "encode", "prefill", "decode")}


async def test_ready_names_the_stages_without_a_live_worker(kafka_bootstrap, redis_url, model_dir):
    s = settings_mod.from_env({}, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, model=str(model_dir),
                              redis_prefix=f"ready-{uuid.uuid4().hex[:8]}", ingress_enabled=False)
    keys = RedisKeys(s.redis_prefix)
    redis = make_redis(s)
    beats: list[asyncio.Task] = []
    try:
        async with procs.in_process_gateway(s) as base, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(base + "/health") as resp:
                assert resp.status == 200
            status, body = await _ready(http, base)
            assert status == 503, body
            assert body["missing_stages"] == ["media-fetch", "encode", "prefill", "decode"]
            assert "no live worker serves stage prefill (needed by text-only requests and requests with media)" \
                in body["problems"], body
            # mode e-pd's prefill+decode worker: text-only requests could be answered, not those with media
            beats.append(asyncio.create_task(heartbeat(redis, keys, _worker(("prefill", "decode")), lambda: True)))
            body = await _until_missing(http, base, ["media-fetch", "encode"])
            assert body["problems"] == ["no live worker serves stage media-fetch (needed by requests with media)",
                                        "no live worker serves stage encode (needed by requests with media)"]
            beats.append(asyncio.create_task(heartbeat(redis, keys, _worker(("media-fetch", "encode")),
                                                       lambda: True)))
            body = await _until(http, base, 200)
            assert body["status"] == "ready" and body["missing_stages"] == []
            assert body["workers"] == {"media-fetch": 1, "encode": 1, "prefill": 1, "decode": 1}
            beats.pop().cancel()  # that worker stops: its record goes with it
            body = await _until(http, base, 503)
            assert body["missing_stages"] == ["media-fetch", "encode"]
            async with http.get(base + "/health") as resp:
                assert resp.status == 200
    finally:
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        await redis.aclose()


async def _until_missing(http, base, missing: list[str], timeout_s: float = 10) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        _, body = await _ready(http, base)
        if body.get("missing_stages") == missing or loop.time() > deadline:
            assert body.get("missing_stages") == missing, body
            return body
        await asyncio.sleep(0.05)
