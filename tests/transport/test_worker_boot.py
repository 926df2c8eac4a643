"""A decode worker's start-up against the real broker and Redis: its decode core loads while the
worker joins its consumer group, and the worker is listed as serving only once both are done; a
core that never gets ready ends the worker with a non-zero exit (its supervisor restarts it)
rather than leaving it joined but unable to decode; a record consumed meanwhile waits for the engines."""

from __future__ import annotations

import asyncio
import uuid

from services import worker as worker_mod
from shared import settings as settings_mod
from shared.engines.decode_core import CoreDecodeEngine
from shared.keys import RedisKeys
from shared.transport.liveness import live_workers
from shared.transport.redis_conn import make_redis
from shared.transport.runner import StageRunner


async def test_a_decode_worker_whose_core_never_gets_ready_is_never_listed_and_exits_1(
        kafka_bootstrap, redis_url, model_dir, tmp_path, monkeypatch):
    runners: list[StageRunner] = []

    class Seen(StageRunner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            runners.append(self)

    until = tmp_path / "core-may-exit"
    monkeypatch.setattr(worker_mod, "StageRunner", Seen)
    monkeypatch.setattr(CoreDecodeEngine, "core_module", "tests.transport.silent_core")
    monkeypatch.setenv("SILENT_CORE_UNTIL", str(until))
    prefix = f"boot-{uuid.uuid4().hex[:8]}"
    settings = settings_mod.from_env({}, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, model=str(model_dir),
                                     redis_prefix=prefix, metrics_port=0)
    redis = make_redis(settings)
    keys = RedisKeys(prefix)
    task = asyncio.create_task(worker_mod.run_worker(settings, ["decode"]))
    listed = assigned_for_s = 0.0
    try:
        async with asyncio.timeout(120):
            while not task.done():
                listed += bool(await live_workers(redis, keys))
                if runners and all(r.assigned.is_set() for r in runners):
                    assigned_for_s += 0.05
                    if assigned_for_s >= 1.0:  # the group's partitions held for a second, the core still loading
                        until.touch()  # now the core exits without a Ready
                await asyncio.sleep(0.05)
            rc = task.result()
    finally:
        until.touch()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await redis.aclose()
    assert assigned_for_s >= 1.0, "the worker never held its partitions"
    assert listed == 0, "listed as serving before its decode core was ready"
    assert rc == 1


async def test_a_stage_handler_runs_only_once_the_engines_can_serve():
    """Records consumed while the decode core loads wait: its eos ids come with its Ready."""
    calls = []

    class Handler:
        async def handle(self, msg, ctx):
            calls.append(msg)
            return "outcome"

    ready = asyncio.Event()
    boot = asyncio.create_task(ready.wait())
    held = worker_mod._AfterStart(Handler(), boot)
    call = asyncio.create_task(held.handle("record", None))
    await asyncio.sleep(0.05)
    assert calls == [] and not call.done()
    ready.set()
    assert await call == "outcome" and calls == ["record"]
