"""A worker process: builds the handlers of the stages it runs and drives each with the generic
runner. The set of stages is configuration (``--stages encode,prefill,decode``), not code.

Shared per process: one Kafka producer, one Redis client, one NIXL agent, one compute lane,
one model instance. SIGTERM/SIGINT stop every runner, which drain within
``drain_timeout_ms``; a runner that dies of a fatal error stops the process (non-zero exit)
so its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from contextlib import AsyncExitStack

import redis.asyncio as aioredis
import torch

from shared.bus import make_producer
from shared.compute import ComputeLane, MicroBatcher
from shared import protocol
from shared.keys import STAGES, RedisKeys
from shared.liveness import heartbeat
from shared.models.registry import resolve_model_path
from shared.runner import StageRunner
from shared.settings import Settings
from shared.stage import Context
from shared.streams import TokenStreams
from shared.transfer import TransferAgent

log = logging.getLogger(__name__)


async def run_worker(settings: Settings, stages: list[str]) -> int:
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise SystemExit(f"unknown stage(s) {unknown or stages}; choose from {', '.join(STAGES)}")
    torch.set_num_threads(settings.torch_threads)
    worker_id = f"{'+'.join(stages)}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    model_dir = resolve_model_path(settings)
    lane = ComputeLane(worker_id)
    async with AsyncExitStack() as stack:
        redis = aioredis.from_url(settings.redis_url)
        stack.push_async_callback(redis.aclose)
        producer = make_producer(settings)
        await producer.start()
        stack.push_async_callback(producer.stop)
        transfer = TransferAgent(worker_id, settings.pool_bytes, lease_ttl_ms=settings.lease_ttl_ms)
        await stack.enter_async_context(transfer)
        streams = TokenStreams(redis, RedisKeys(settings.redis_prefix), maxlen=settings.stream_maxlen,
                               ttl_s=settings.stream_ttl_s)
        runners = []
        for stage in stages:
            handler, concurrency = await _build_handler(stage, settings, model_dir, lane, stack)
            topic, union = STAGES[stage]
            ctx = Context(stage=stage, worker_id=worker_id, events=streams, transfer=transfer)
            runners.append(StageRunner(stage=stage, topic=topic, union=union, handler=handler, ctx=ctx,
                                       producer=producer, settings=settings, concurrency=concurrency))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [r.stop() for r in runners])
        log.info("worker %s running stages %s (model %s)", worker_id, stages, model_dir)
        tasks = [asyncio.create_task(r.run(), name=r.stage) for r in runners]
        info = protocol.WorkerInfo(worker_id=worker_id, stages=tuple(stages), pid=os.getpid(),
                                   host=socket.gethostname(), started_unix_ms=int(time.time() * 1000))
        beat = asyncio.create_task(heartbeat(redis, RedisKeys(settings.redis_prefix), info,
                                             lambda: all(r.assigned.is_set() for r in runners)))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for r in runners:  # one runner ending (stop or fatal) ends the process
            r.stop()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    lane.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    for exc in failed:
        log.error("runner failed: %r", exc)
    return 1 if failed else 0


_compute_cache: dict[str, object] = {}


def _compute(model_dir) -> object:
    """One model instance per process, shared by every stage it runs."""
    key = str(model_dir)
    if key not in _compute_cache:
        from shared.engines.qwen2_vl import Qwen2VLCompute

        _compute_cache[key] = Qwen2VLCompute(model_dir)
    return _compute_cache[key]


async def _build_handler(stage: str, settings: Settings, model_dir, lane: ComputeLane, stack: AsyncExitStack):
    if stage == "media-fetch":
        from services.media_fetch.handler import MediaFetchHandler
        from shared.engines.qwen2_vl import ImagePreprocessor
        from shared.media.fetch import MediaFetcher

        fetcher = await stack.enter_async_context(
            MediaFetcher(allow_hosts=settings.media_allow_hosts, timeout_ms=settings.media_fetch_timeout_ms))
        return MediaFetchHandler(settings, fetcher, ImagePreprocessor(model_dir), lane), None
    if stage == "encode":
        from services.encode.handler import EncodeHandler

        from shared.engines.qwen2_vl import ImagePixels

        compute = _compute(model_dir)

        def encode_batch(items):
            return compute.encode_images([ImagePixels(px, grid, n) for px, grid, n in items])

        batcher = MicroBatcher(encode_batch, lane, max_items=settings.encode_max_batch_items,
                               max_wait_ms=settings.encode_batch_wait_ms)
        await batcher.start()
        stack.push_async_callback(batcher.stop)
        return EncodeHandler(batcher), None
    if stage == "prefill":
        from services.prefill.handler import PrefillHandler

        compute = _compute(model_dir)
        return PrefillHandler(compute, lane, max_model_len=compute.max_model_len), None
    if stage == "decode":
        from services.decode.handler import DecodeHandler

        return DecodeHandler(_compute(model_dir), lane), settings.decode_concurrency
    raise AssertionError(stage)
