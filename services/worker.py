"""A worker process: builds the handlers of the stages it runs and drives each entry stage with
the generic runner. The set of stages is configuration (``--stages encode,prefill,decode``),
see :mod:`shared.modes` for the layouts and what crosses Kafka.

Shared per process: one Kafka producer, one Redis client, one NIXL agent, one engine per kind
(the language-model engine chosen by ``settings.engine``; the transformers vision encoder for
the encode stage, the same instance when the engine is transformers). The engine is checked
against the layout before anything is consumed. SIGTERM/SIGINT stop every runner, which
drain within ``drain_timeout_ms``; a runner that dies of a fatal error stops the process
(non-zero exit) so its supervisor restarts it.

Every worker serves ``/metrics`` on ``metrics_host:metrics_port`` (0: an ephemeral port) from
start-up on; the bound port is in its liveness record (``WorkerInfo.metrics_port``).
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
from dataclasses import dataclass

import torch
from redis.asyncio import Redis

from shared import hostaddr, logs, metrics, protocol
from shared.bus import make_producer
from shared.device import resolve_placement
from shared.doorbell import Doorbell
from shared.engines.base import Engine
from shared.keys import STAGES, TOPIC_PREFILL, RedisKeys
from shared.kv.prefix_cache import PrefixCache
from shared.kv.reuse import EngineCacheReport, PrefixReuse
from shared.kv.router import Router
from shared.kv.table import KvTableUpdater, LoadReporter, LoadTracker
from shared.ledger import StageLedger
from shared.liveness import heartbeat
from shared.metrics import MetricsServer
from shared.models.registry import family_of, placeholder_token_id, resolve_model_path, served_modalities
from shared.modes import check_engine, entry_stages, normalise
from shared.redis_conn import make_redis
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


def make_engine(name: str, settings: Settings, model_dir, stages: tuple[str, ...] = ()) -> Engine:
    """The engine for a worker running ``stages``: a vLLM engine running prefill apart from
    decode is built as KV producer, one running decode apart as KV consumer (vllm_pd)."""
    cls = _engine_class(name)
    if name == "transformers":
        return cls(model_dir, encode_max_batch_items=settings.encode_max_batch_items,
                   encode_batch_wait_ms=settings.encode_batch_wait_ms, device=settings.device, dtype=settings.dtype,
                   decode_max_batch=settings.decode_max_batch)
    from shared.engines import vllm_pd

    role = None
    if "prefill" in stages and "decode" not in stages:
        role = vllm_pd.PRODUCER
    elif "decode" in stages and "prefill" not in stages:
        role = vllm_pd.CONSUMER
    host = settings.vllm_kv_host
    if host == "auto":
        host = socket.gethostbyname(socket.gethostname())
    return cls(model_dir, kv_role=role, kv_host=host, kv_lease_s=max(1, settings.lease_ttl_ms // 1000),
               kv_block_size=settings.kv_block_size)


def engine_capabilities(name: str):
    """Capabilities without starting the engine (for start-up checks)."""
    return _engine_class(name).capabilities


async def run_worker(settings: Settings, stages_arg: list[str]) -> int:
    stages = normalise(stages_arg)
    if {"prefill", "decode"} & set(stages):
        check_engine(stages, settings.engine, engine_capabilities(settings.engine))
    torch.set_num_threads(settings.torch_threads)
    worker_id = f"{'+'.join(stages)}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs.set_process(worker_id)
    model_dir = resolve_model_path(settings)
    try:  # an engine that cannot serve this model family, or a GPU that is not there, fails here
        served_modalities(family_of(model_dir), settings.engine)
        if settings.engine == "vllm":  # weights vLLM's loader cannot map (shared.engines.vllm_inputs)
            from shared.engines.vllm_inputs import checkpoint_refusal

            why = checkpoint_refusal(model_dir, family_of(model_dir).name)
            if why:
                raise ValueError(why)
        placement = resolve_placement(settings.device, settings.dtype)
    except ValueError as exc:
        raise SystemExit(f"cannot start worker: {exc}") from None
    async with AsyncExitStack() as stack:
        metrics_server = await stack.enter_async_context(MetricsServer(settings.metrics_host, settings.metrics_port))
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, metrics_server.port)
        redis = make_redis(settings)
        stack.push_async_callback(redis.aclose)
        producer = make_producer(settings)
        await producer.start()
        stack.push_async_callback(producer.stop)
        # UCX reads its variables when the agent is created: pin the advertised host's device
        # first, so the agent metadata peers receive names that interface, not loopback
        os.environ.update(hostaddr.ucx_env(settings))
        transfer = TransferAgent(worker_id, settings.pool_bytes, lease_ttl_ms=settings.lease_ttl_ms,
                                 host=hostaddr.advertise_host(settings), device=placement.device,
                                 cuda_ipc=settings.transfer_cuda_ipc)
        await stack.enter_async_context(transfer)
        metrics.watch_pool(transfer)
        streams = TokenStreams(redis, RedisKeys(settings.redis_prefix), maxlen=settings.stream_maxlen,
                               ttl_s=settings.stream_ttl_s)
        keys = RedisKeys(settings.redis_prefix)
        placeholder = placeholder_token_id(model_dir)
        # KV-aware routing: every process may produce to mm.prefill (restarts included), so each
        # routes; a prefill worker apart from decode keeps a prefix cache and reports to the table
        router = Router(redis, keys, settings, placeholder)
        load = LoadTracker()
        kv_worker = "prefill" in stages and "decode" not in stages
        # the metric label leaves out pid and random suffix: a restart continues the same series
        # (processes on one host are told apart by the scrape target, Prometheus' `instance`)
        label = f"{'+'.join(stages)}@{socket.gethostname()}"
        caps = engine_capabilities(settings.engine)
        reuse = PrefixReuse(PrefixCache(settings.prefix_cache_bytes, settings.kv_block_size), placeholder,
                            metric_label=label) \
            if kv_worker and caps.prefix_kv and settings.prefix_cache_bytes > 0 else None
        # an engine with its own prefix cache (vLLM) reports it in the same block keys
        engine_cache = EngineCacheReport(placeholder, settings.kv_block_size, metric_label=label) \
            if kv_worker and caps.kv_events else None
        reporter = LoadReporter(redis, keys, worker_id, load, settings) if kv_worker else None
        handlers = await _build_handlers(stages, settings, model_dir, stack,
                                         _CacheParts(redis, transfer, worker_id), reuse, load,
                                         router.audit if reuse is not None or engine_cache is not None else None,
                                         engine_cache)
        ledger = StageLedger(redis, RedisKeys(settings.redis_prefix), lease_ms=settings.stage_lease_ms,
                             done_ttl_s=settings.done_ttl_s)
        contexts = {s: Context(stage=s, worker_id=worker_id, events=streams, transfer=transfer, ledger=ledger)
                    for s in stages}
        local = {STAGES[s][0]: (h, contexts[s]) for s, h in handlers.items()}
        doorbell = None
        if settings.doorbell:
            doorbell = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=settings.idle_fetch_interval_ms)
            stack.push_async_callback(doorbell.close)
        runners = []
        for stage in entry_stages(stages):
            topic, union = STAGES[stage]
            concurrency = settings.decode_concurrency if stage in ("decode", "prefill") and "decode" in stages \
                else None
            runners.append(StageRunner(stage=stage, topic=topic, union=union, handler=handlers[stage],
                                       ctx=contexts[stage], producer=producer, settings=settings,
                                       concurrency=concurrency, local_routes=local, router=router,
                                       rebalance_listener=reporter if topic == TOPIC_PREFILL else None,
                                       doorbell=doorbell))
        updater = KvTableUpdater(redis, keys, settings) if kv_worker else None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [r.stop() for r in [*runners, *([updater] if updater else [])]])
        log.info("worker %s running stages %s (engine %s, model %s, device %s, dtype %s)", worker_id, stages,
                 settings.engine, model_dir, placement.device, str(placement.dtype).removeprefix("torch."))
        tasks = [asyncio.create_task(r.run(), name=r.stage) for r in runners]
        if updater is not None:  # it ending (broker gone) ends the process like a runner's end
            tasks.append(asyncio.create_task(updater.run(), name="kv-table"))
        background = [asyncio.create_task(reporter.run(), name="kv-report")] if reporter else []
        info = protocol.WorkerInfo(worker_id=worker_id, stages=stages, pid=os.getpid(),
                                   host=hostaddr.advertise_host(settings), started_unix_ms=int(time.time() * 1000),
                                   metrics_port=metrics_server.port,
                                   metrics_url=hostaddr.http_url(hostaddr.advertise_host(settings),
                                                                 metrics_server.port) + "/metrics")
        beat = asyncio.create_task(heartbeat(redis, RedisKeys(settings.redis_prefix), info,
                                             lambda: all(r.assigned.is_set() for r in runners)))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stopping_at = time.monotonic()
        for r in [*runners, *([updater] if updater else [])]:  # one ending (stop or fatal) ends the process
            r.stop()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for t in [beat, *background]:
            t.cancel()
        await asyncio.gather(beat, *background, return_exceptions=True)
        log.info("worker %s: consumers stopped in %.1f s; releasing resources", worker_id,
                 time.monotonic() - stopping_at)
    log.info("worker %s stopped in %.1f s", worker_id, time.monotonic() - stopping_at)
    failed = [r for r in results if isinstance(r, BaseException)]
    for exc in failed:
        log.error("runner failed: %r", exc)
    return 1 if failed else 0


@dataclass
class _CacheParts:
    """What the embedding cache needs from the process (used only when it is on)."""

    redis: Redis
    transfer: TransferAgent
    worker_id: str


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


async def _build_handlers(stages: tuple[str, ...], settings: Settings, model_dir, stack: AsyncExitStack,
                          parts: _CacheParts, reuse: PrefixReuse | None = None,
                          load: LoadTracker | None = None, audit=None,
                          engine_cache: EngineCacheReport | None = None) -> dict:
    engines: dict[str, Engine] = {}
    index = None
    if settings.embedding_cache_bytes > 0:
        from shared.embcache.index import EmbeddingIndex

        index = EmbeddingIndex(parts.redis, RedisKeys(settings.redis_prefix), ttl_s=settings.embedding_index_ttl_s,
                               lease_ms=settings.embedding_coalesce_lease_ms)

    async def engine(name: str) -> Engine:
        if name not in engines:
            eng = make_engine(name, settings, model_dir, stages)
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
        fingerprint = ""
        if index is not None:
            from shared.embcache.identity import model_fingerprint

            fingerprint = await asyncio.to_thread(model_fingerprint, model_dir)
        pre = _preprocessors(model_dir, served_modalities(family_of(model_dir), settings.engine))
        handlers["media-fetch"] = MediaFetchHandler(settings, fetcher, pre.get("image"), lane,
                                                    preprocess_video=pre.get("video"),
                                                    preprocess_audio=pre.get("audio"),
                                                    embeds_hidden_size=_hidden_size(model_dir) if "image" in pre else 0,
                                                    index=index, fingerprint=fingerprint)
    if "encode" in stages:
        from services.encode.handler import EncodeHandler

        cache = None
        if index is not None:
            from shared.embcache.coalesce import EncodeCache
            from shared.embcache.store import EmbeddingStore

            # the pool also holds every in-flight tensor: the cache may pin at most half of it
            capacity = min(settings.embedding_cache_bytes, settings.pool_bytes // 2)
            if capacity < settings.embedding_cache_bytes:
                log.warning("embedding_cache_bytes %d exceeds half of pool_bytes %d: caching %d bytes",
                            settings.embedding_cache_bytes, settings.pool_bytes, capacity)
            store = EmbeddingStore(parts.transfer, index, capacity_bytes=capacity,
                                   max_item_fraction=settings.embedding_cache_max_item_fraction)
            stack.push_async_callback(store.close)  # runs before the agent stops: entries go first
            cache = EncodeCache(store, index, parts.transfer, parts.worker_id,
                                wait_ms=settings.embedding_coalesce_wait_ms)
            stack.push_async_callback(cache.drain)  # runs before store.close
        handlers["encode"] = EncodeHandler(await engine("transformers"), cache)  # the vision encoder
    if "prefill" in stages:
        from shared.embcache.pull import EmbeddingPuller
        from shared.embcache.recent import RecentEmbeddings

        recent = RecentEmbeddings(settings.prefill_embedding_cache_bytes) \
            if index is not None and settings.prefill_embedding_cache_bytes > 0 else None
        puller = EmbeddingPuller(index, recent)
        lm = await engine(settings.engine)
        if "decode" in stages:
            from services.decode.handler import GenerateHandler

            handlers["prefill"] = GenerateHandler(lm, puller)
        else:
            from services.prefill.handler import PrefillHandler

            handlers["prefill"] = PrefillHandler(lm, reuse, load, puller, audit, engine_cache)
    if "decode" in stages and "prefill" not in stages:
        from services.decode.handler import DecodeHandler

        handlers["decode"] = DecodeHandler(await engine(settings.engine))
    return handlers
