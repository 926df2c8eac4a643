"""The fleet view's collector and ``/fleet/snapshot`` against a real redis-server and real
``/metrics`` servers (no fleet): liveness records are written the way workers and gateways
write them, each process's ``/metrics`` is the real exposition of this test process, and the
page's routes run in a real aiohttp server with API keys configured."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import aiohttp
from aiohttp import web

from services.fleetview import page as fleet_page
from services.gateway.auth import hash_key
from shared import metrics, protocol
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.transport.redis_conn import make_redis
from tests import procs

PREFIX = "fleetview"
KEY = "sk-fleet-view-test"


def _worker(worker_id: str, port: int, stages: tuple[str, ...]) -> bytes:
    return protocol.encode(protocol.WorkerInfo(worker_id=worker_id, stages=stages, pid=os.getpid(),
                                               host=socket.gethostname(), started_unix_ms=int(time.time() * 1000),
                                               metrics_port=port))


async def _fetch(session: aiohttp.ClientSession, url: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers) as resp:
        return resp.status, (await resp.json() if resp.content_type == "application/json" else await resp.text())


def test_snapshot_follows_the_key_rule_and_tracks_workers_up_down_gone(redis_url):
    async def go():
        settings = settings_mod.from_env({}, redis_url=redis_url, redis_prefix=PREFIX,
                                         api_key_hashes=(hash_key(KEY),))
        keys = RedisKeys(PREFIX)
        redis = make_redis(settings)
        app = web.Application()
        app.router.add_get("/metrics", metrics.metrics_view)
        fleet_page.add_routes(app, settings)
        runner = web.AppRunner(app)
        await runner.setup()
        port = procs.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        metrics.STAGE_RECORDS.labels("encode", "ok").inc(3)  # something for the sums to show
        dead_port = procs.free_port()  # nothing listens here: that worker's /metrics is unreachable
        try:
            await redis.set(keys.gateway("gw-1"), protocol.encode(protocol.GatewayInfo(
                gateway_id="gw-1", url=base, pid=os.getpid(), host="localhost", started_unix_ms=0)), px=60_000)
            await redis.set(keys.worker("enc-1"), _worker("enc-1", port, ("encode",)), px=60_000)
            await redis.set(keys.worker("dec-1"), _worker("dec-1", dead_port, ("decode",)), px=60_000)
            now_ms = int(time.time() * 1000)  # listed as keep_record lists them (shared.transport.liveness)
            await redis.zadd(keys.gateways_index(), {keys.gateway("gw-1"): now_ms})
            await redis.zadd(keys.workers_index(), {keys.worker("enc-1"): now_ms, keys.worker("dec-1"): now_ms})
            async with aiohttp.ClientSession() as session:
                assert (await _fetch(session, base + "/fleet/snapshot"))[0] == 401
                assert (await _fetch(session, base + "/fleet/snapshot", "sk-wrong"))[0] == 401
                status, page = await _fetch(session, base + "/fleet")
                assert status == 200 and "/fleet/static/fleet.js" in page  # the shell holds no data
                assert (await _fetch(session, base + "/fleet/static/fleet.js"))[0] == 200
                assert (await _fetch(session, base + "/fleet/static/..%2Fpage.py"))[0] == 404

                status, snap = await _fetch(session, base + "/fleet/snapshot", KEY)
                assert status == 200, snap
                states = {p["id"]: p["state"] for p in snap["processes"]}
                assert states == {"gw-1": "up", "enc-1": "up", "dec-1": "down"}, snap["processes"]
                encode = next(s for s in snap["stages"] if s["stage"] == "encode")
                # this process is scraped twice (as gateway and as enc-1): both scrapes count
                assert encode["workers_up"] == 1 and encode["records_total"] >= 6
                decode = next(s for s in snap["stages"] if s["stage"] == "decode")
                assert decode["workers_up"] == 0 and decode["workers_down"] == 1

                await redis.delete(keys.worker("enc-1"))  # a clean stop, or its TTL ran out
                await asyncio.sleep(1.1)  # one collector interval: calls within it share a collection
                status, snap = await _fetch(session, base + "/fleet/snapshot", KEY)
                states = {p["id"]: p["state"] for p in snap["processes"]}
                assert states == {"gw-1": "up", "enc-1": "gone", "dec-1": "down"}, snap["processes"]
        finally:
            await redis.delete(keys.gateway("gw-1"), keys.worker("enc-1"), keys.worker("dec-1"),
                               keys.gateways_index(), keys.workers_index())
            await redis.aclose()
            await runner.cleanup()

    asyncio.run(go())
