"""A worker process: builds the handlers of the stages it runs and drives each entry stage with
the generic runner. The set of stages is configuration (``--stages encode,prefill,decode``),
see :mod:`shared.modes` for the layouts and what crosses Kafka.

Shared per process: one Kafka producer, one Redis client, one NIXL agent, one engine per kind
(the language-model engine chosen by ``settings.engine``; the transformers vision encoder for
the encode stage, the same instance when the engine is transformers). The engine is checked
against the layout before anything is consumed. SIGTERM/SIGINT stop every runner, which
drain within ``drain_timeout_ms``; a runner that dies of a fatal error stops the process
(non-zero exit) so its supervisor restarts it.
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

from shared import protocol
from shared.bus import make_producer
from shared.engines.base import Engine
from shared.keys import STAGES, RedisKeys
from shared.ledger import StageLedger
from shared.liveness import heartbeat
from shared.modes import check_engine, entry_stages, normalise
from shared.models.registry import family_of, resolve_model_path, served_modalities
from shared.runner import StageRunner
from shared.settings import Settings
from shared.stage import Context
from shared.streams import TokenStreams
from shared.transfer import TransferAgent

log = logging.getLogger(__name__)


def _engine_class(name: str):
    if name == "transformers":
        from shared.engines.transformers_engine import TransformersEngine

        return TransformersEngine
    if name == "vllm":
        from shared.engines.vllm_engine import VllmEngine

        return VllmEngine
    raise SystemExit(f"unknown engine {name!r}; choose transformers or vllm")


def make_engine(name: str, settings: Settings, model_dir) -> Engine:
    cls = _engine_class(name)
    if name == "transformers":
        return cls(model_dir, encode_max_batch_items=settings.encode_max_batch_items,
                   encode_batch_wait_ms=settings.encode_batch_wait_ms)
    return cls(model_dir)


def engine_capabilities(name: str):
    """Capabilities without starting the engine (for start-up checks)."""
    return _engine_class(name).capabilities


async def run_worker(settings: Settings, stages_arg: list[str]) -> int:
    stages = normalise(stages_arg)
    if {"prefill", "decode"} & set(stages):
        check_engine(stages, settings.engine, engine_capabilities(settings.engine))
    torch.set_num_threads(settings.torch_threads)
    worker_id = f"{'+'.join(stages)}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    model_dir = resolve_model_path(settings)
    try:  # an engine that cannot serve this model family fails here, loudly, before taking traffic
        served_modalities(family_of(model_dir), settings.engine)
    except ValueError as exc:
        raise SystemExit(f"cannot start worker: {exc}") from None
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
        handlers = await _build_handlers(stages, settings, model_dir, stack)
        ledger = StageLedger(redis, RedisKeys(settings.redis_prefix), lease_ms=settings.stage_lease_ms,
                             done_ttl_s=settings.done_ttl_s)
        contexts = {s: Context(stage=s, worker_id=worker_id, events=streams, transfer=transfer, ledger=ledger)
                    for s in stages}
        local = {STAGES[s][0]: (h, contexts[s]) for s, h in handlers.items()}
        runners = []
        for stage in entry_stages(stages):
            topic, union = STAGES[stage]
            concurrency = settings.decode_concurrency if stage in ("decode", "prefill") and "decode" in stages \
                else None
            runners.append(StageRunner(stage=stage, topic=topic, union=union, handler=handlers[stage],
                                       ctx=contexts[stage], producer=producer, settings=settings,
                                       concurrency=concurrency, local_routes=local))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [r.stop() for r in runners])
        log.info("worker %s running stages %s (engine %s, model %s)", worker_id, stages, settings.engine, model_dir)
        tasks = [asyncio.create_task(r.run(), name=r.stage) for r in runners]
        info = protocol.WorkerInfo(worker_id=worker_id, stages=stages, pid=os.getpid(),
                                   host=socket.gethostname(), started_unix_ms=int(time.time() * 1000))
        beat = asyncio.create_task(heartbeat(redis, RedisKeys(settings.redis_prefix), info,
                                             lambda: all(r.assigned.is_set() for r in runners)))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for r in runners:  # one runner ending (stop or fatal) ends the process
            r.stop()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    for exc in failed:
        log.error("runner failed: %r", exc)
    return 1 if failed else 0


def _hidden_size(model_dir) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "text_config", config).hidden_size)


def _preprocessors(model_dir, served: frozenset[str]) -> dict:
    """modality -> the model's own processor for it (no weights), for the modalities served."""
    out: dict = {}
    family = family_of(model_dir).name
    if family == "qwen2_audio":
        from shared.engines.qwen2_audio import AudioPreprocessor

        out["audio"] = AudioPreprocessor(model_dir)
    elif family == "llava":
        from shared.engines.llava import LlavaImagePreprocessor

        out["image"] = LlavaImagePreprocessor(model_dir)
    elif family == "llava_next_video":
        from shared.engines.llava import NextVideoPreprocessor

        out["video"] = NextVideoPreprocessor(model_dir)
    else:
        from shared.engines.qwen2_vl import ImagePreprocessor, VideoPreprocessor

        out["image"] = ImagePreprocessor(model_dir)
        if "video" in served:
            out["video"] = VideoPreprocessor(model_dir)
    return {m: p for m, p in out.items() if m in served}


async def _build_handlers(stages: tuple[str, ...], settings: Settings, model_dir, stack: AsyncExitStack) -> dict:
    engines: dict[str, Engine] = {}

    async def engine(name: str) -> Engine:
        if name not in engines:
            eng = make_engine(name, settings, model_dir)
            await eng.start()
            stack.push_async_callback(eng.stop)
            engines[name] = eng
        return engines[name]

    handlers: dict = {}
    if "media-fetch" in stages:
        from services.media_fetch.handler import MediaFetchHandler
        from shared.compute import ComputeLane
        from shared.media.fetch import MediaFetcher

        fetcher = await stack.enter_async_context(MediaFetcher.from_settings(settings))
        lane = ComputeLane("media")
        stack.callback(lane.close)
        pre = _preprocessors(model_dir, served_modalities(family_of(model_dir), settings.engine))
        handlers["media-fetch"] = MediaFetchHandler(settings, fetcher, pre.get("image"), lane,
                                                    preprocess_video=pre.get("video"),
                                                    preprocess_audio=pre.get("audio"),
                                                    embeds_hidden_size=_hidden_size(model_dir) if "image" in pre else 0)
    if "encode" in stages:
        from services.encode.handler import EncodeHandler

        handlers["encode"] = EncodeHandler(await engine("transformers"))  # the vision encoder
    if "prefill" in stages:
        lm = await engine(settings.engine)
        if "decode" in stages:
            from services.decode.handler import GenerateHandler

            handlers["prefill"] = GenerateHandler(lm)
        else:
            from services.prefill.handler import PrefillHandler

            handlers["prefill"] = PrefillHandler(lm)
    if "decode" in stages and "prefill" not in stages:
        from services.decode.handler import DecodeHandler

        handlers["decode"] = DecodeHandler(await engine(settings.engine))
    return handlers
