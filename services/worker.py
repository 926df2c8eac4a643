"""A worker process: builds the stages it runs (``--stages encode,prefill,decode``, each from its
``StageSpec`` in ``services.stages``; layouts in :mod:`services.modes`) and drives each entry
stage with the generic runner.

Shared per process: one Kafka producer, one Redis client, one NIXL agent, one engine per kind,
checked against the layout before anything is consumed. SIGTERM/SIGINT stop every runner, which
drain within ``drain_timeout_ms``; a runner's fatal error stops the process (non-zero exit) so
its supervisor restarts it. Redis must answer at start (a Redis stall later is ridden out).
``/metrics`` is served on ``metrics_host:metrics_port`` from start-up (0: an ephemeral port,
named in ``WorkerInfo.metrics_port``). Design: docs/design/architecture.md.
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

import torch
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.modes import check_engine, entry_stages, normalise
from services.stages import BY_NAME, SPECS
from shared import logs, metrics, protocol
from shared.engines.base import Engine
from shared.engines.registry import engine_capabilities, make_engine
from shared.keys import RedisKeys
from shared.kv.router import Router
from shared.metrics import MetricsServer
from shared.models.registry import family_of, placeholder_token_id, resolve_model_path, served_modalities
from shared.process import gcpolicy, hostaddr
from shared.process.aio import succeeded
from shared.process.device import resolve_placement
from shared.settings import Settings, redact_url
from shared.stage import Context, StageParts
from shared.transfer import TransferAgent
from shared.transport.bus import make_producer
from shared.transport.doorbell import Doorbell
from shared.transport.ledger import StageLedger
from shared.transport.liveness import heartbeat
from shared.transport.redis_conn import make_redis
from shared.transport.redis_lean import lean_of
from shared.transport.runner import StageRunner
from shared.transport.streams import TokenStreams

log = logging.getLogger(__name__)


async def run_worker(settings: Settings, stages_arg: list[str], spawner=None) -> int:
    """``spawner``: a ``shared.process.zygote.Zygote`` this worker forked (services/cli.py) for its
    decode core; stopped with the worker."""
    stages = normalise(stages_arg)
    model_dir, placement = _preflight(settings, stages)
    torch.set_num_threads(settings.torch_threads)
    worker_id = f"{'+'.join(stages)}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs.set_process(worker_id)
    async with AsyncExitStack() as stack:
        if spawner is not None:  # after the engines (the exit stack unwinds in reverse)
            stack.callback(spawner.stop)
        metrics_server = await stack.enter_async_context(MetricsServer(settings.metrics_host, settings.metrics_port))
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, metrics_server.port)
        redis = make_redis(settings)
        stack.push_async_callback(redis.aclose)
        stack.push_async_callback(lean_of(redis).close)
        await _redis_answers(redis, settings)
        producer = make_producer(settings)
        await producer.start()
        stack.push_async_callback(producer.stop)
        # UCX reads its variables when the agent is created: pin the advertised host's device
        # first, so the agent metadata peers receive names that interface, not loopback
        os.environ.update(hostaddr.ucx_env(settings))
        transfer = TransferAgent(worker_id, settings.pool_bytes, lease_ttl_ms=settings.lease_ttl_ms,
                                 host=hostaddr.advertise_host(settings), device=placement.device,
                                 cuda_ipc=settings.transfer_cuda_ipc, shared_pool=settings.transfer_host_shm,
                                 progress_wake_ms=settings.nixl_progress_wake_ms)
        await stack.enter_async_context(transfer)
        metrics.watch_pool(transfer)
        streams = TokenStreams(redis, RedisKeys(settings.redis_prefix), maxlen=settings.stream_maxlen,
                               ttl_s=settings.stream_ttl_s)
        stack.push_async_callback(streams.close)
        keys = RedisKeys(settings.redis_prefix)
        # KV-aware routing: every process may produce to mm.prefill (restarts included), so each routes
        router = Router(redis, keys, settings, placeholder_token_id(model_dir))
        doorbell = None
        if settings.doorbell:
            doorbell = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=settings.idle_fetch_interval_ms)
            stack.push_async_callback(doorbell.close)
        engines = _Engines(settings, model_dir, stages, stack, spawner)
        parts = StageParts(settings=settings, model_dir=model_dir, stages=stages, stack=stack,
                           engine=engines, redis=redis, keys=keys,
                           transfer=transfer, worker_id=worker_id, router=router, index=_index(settings, redis, keys),
                           doorbell=doorbell)
        built = {}
        for spec in SPECS:  # pipeline order: engines start in it
            if spec.name in stages and (b := await spec.build(parts)) is not None:
                built[spec.name] = b
        ledger = StageLedger(redis, keys, lease_ms=settings.stage_lease_ms, done_ttl_s=settings.done_ttl_s)
        contexts = {s: Context(stage=s, worker_id=worker_id, events=streams, transfer=transfer, ledger=ledger)
                    for s in stages}
        # every engine can serve (the two overlap, see _Engines) before a worker is listed as serving
        # and before any handler reads an engine's facts (the decode core's eos ids come with its Ready)
        boot = asyncio.create_task(engines.started(), name="engines-started")
        handlers = {s: _AfterStart(b.handler, boot) for s, b in built.items()}
        local = {BY_NAME[s].topic: (handlers[s], contexts[s]) for s in built}
        runners = [StageRunner(stage=stage, topic=BY_NAME[stage].topic, union=BY_NAME[stage].message,
                               handler=handlers[stage], ctx=contexts[stage], producer=producer, settings=settings,
                               concurrency=built[stage].concurrency, local_routes=local, router=router,
                               rebalance_listener=built[stage].listener, doorbell=doorbell)
                   for stage in entry_stages(stages)]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [r.stop() for r in runners])
        log.info("worker %s running stages %s (engine %s, model %s, device %s, dtype %s)", worker_id, stages,
                 settings.engine, model_dir, placement.device, str(placement.dtype).removeprefix("torch."))
        gcpolicy.serving()  # engines built: the collector back on, start-up's heap frozen
        tasks = [asyncio.create_task(r.run(), name=r.stage) for r in runners]
        background = [asyncio.create_task(run()) for b in built.values() for run in b.background]
        info = protocol.WorkerInfo(worker_id=worker_id, stages=stages, pid=os.getpid(),
                                   host=hostaddr.advertise_host(settings), started_unix_ms=int(time.time() * 1000),
                                   metrics_port=metrics_server.port,
                                   metrics_url=hostaddr.http_url(hostaddr.advertise_host(settings),
                                                                 metrics_server.port) + "/metrics")
        beat = asyncio.create_task(heartbeat(redis, RedisKeys(settings.redis_prefix), info,
                                             lambda: succeeded(boot) and all(r.assigned.is_set() for r in runners)))
        results, stopping_at = await _until_a_runner_ends(runners, tasks, boot, [beat, *background])
        log.info("worker %s: runners stopped in %.1f s; releasing resources", worker_id,
                 time.monotonic() - stopping_at)
    log.info("worker %s stopped in %.1f s", worker_id, time.monotonic() - stopping_at)
    failed = [r for r in results if isinstance(r, BaseException)]
    for exc in failed:
        log.error("runner failed: %r", exc)
    return 1 if failed else 0


def _preflight(settings: Settings, stages: tuple[str, ...]):
    """The model folder and the placement, or ``SystemExit`` saying why this worker cannot start:
    a layout its engine cannot serve, a model not there, an engine that cannot serve the model's
    family or load its weights, a GPU not there, vLLM settings that clash."""
    if {"prefill", "decode"} & set(stages):
        check_engine(stages, settings.engine, engine_capabilities(settings.engine))
    try:
        model_dir = resolve_model_path(settings)
        served_modalities(family_of(model_dir), settings.engine)
        if settings.engine == "vllm":  # weights vLLM's loader cannot map (shared.engines.vllm_inputs)
            from shared.engines.vllm_inputs import checkpoint_refusal

            why = checkpoint_refusal(model_dir, family_of(model_dir).name)
            if why:
                raise ValueError(why)
        placement = resolve_placement(settings.device, settings.dtype)
        if settings.engine == "vllm":  # KV blocks asked on a GPU by a CPU worker: refuse here, not mid-start
            from shared.engines.vllm_pd import kv_buffer_device

            kv_buffer_device(settings.vllm_kv_buffer_device, str(placement.device))
            if {"prefill", "decode"} & set(stages):  # serving knobs this device or model cannot take
                from shared.engines.vllm_config import check

                check(settings, model_dir)
        if settings.engine == "sglang" and {"prefill", "decode"} & set(stages):  # no SGLang, no GPU: at once
            from shared.engines.sglang_config import check as check_sglang

            check_sglang(settings, model_dir)
    except ValueError as exc:
        raise SystemExit(f"cannot start worker: {exc}") from None
    return model_dir, placement


async def _redis_answers(redis: Redis, settings: Settings) -> None:
    """``SystemExit`` naming the URL (never a password) unless Redis answers a PING within
    ``redis_timeout_ms``: a wrong URL or password stops the worker here, loudly, rather than
    being retried as an outage."""
    try:
        await redis.ping()
    except RedisError as exc:
        raise SystemExit(f"cannot start worker: Redis at {redact_url(settings.redis_url)} did not answer: "
                         f"{type(exc).__name__}: {exc}") from None


async def _until_a_runner_ends(runners: list[StageRunner], tasks: list[asyncio.Task], boot: asyncio.Task,
                               beside: list[asyncio.Task]) -> tuple[list, float]:
    """Serve until one runner ends (stopped or failed) or the engines fail to start; then stop
    every runner and cancel what ran ``beside`` them. Their results (exceptions included) and
    when stopping began."""
    done, _ = await asyncio.wait([*tasks, boot], return_when=asyncio.FIRST_COMPLETED)
    if done == {boot} and succeeded(boot):
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    stopping_at = time.monotonic()
    for r in runners:  # one ending (stop or fatal) ends the process
        r.stop()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    if boot.done() and not boot.cancelled() and not succeeded(boot):  # an engine that never could serve
        results.append(boot.exception())
    for t in [boot, *beside]:
        t.cancel()
    await asyncio.gather(boot, *beside, return_exceptions=True)
    return results, stopping_at


class _AfterStart:
    """A stage's handler whose calls wait for the worker's engines to be able to serve."""

    def __init__(self, inner, boot: asyncio.Task) -> None:
        self._inner, self._boot = inner, boot

    async def handle(self, msg, ctx):
        await asyncio.shield(self._boot)  # done, but for records consumed while an engine loads
        return await self._inner.handle(msg, ctx)


def _index(settings: Settings, redis: Redis, keys: RedisKeys):
    """The embedding index (shared by media-fetch, encode and prefill), None with the cache off."""
    if settings.embedding_cache_bytes <= 0:
        return None
    from shared.embcache.index import EmbeddingIndex

    return EmbeddingIndex(redis, keys, ttl_s=settings.embedding_index_ttl_s,
                          lease_ms=settings.embedding_coalesce_lease_ms)


class _Engines:
    """``await engines(kind)``: the process's one engine of that kind, started on first use and
    stopped with the worker. An engine whose ``start`` returns before it can serve (the decode
    core loads its model in its own process) has ``started()``: :meth:`started` waits for them all."""

    def __init__(self, settings: Settings, model_dir, stages: tuple[str, ...], stack: AsyncExitStack,
                 spawner=None) -> None:
        self._settings, self._model_dir, self._stages, self._stack = settings, model_dir, stages, stack
        self._spawner = spawner
        self._by_name: dict[str, Engine] = {}

    async def __call__(self, name: str) -> Engine:
        if name not in self._by_name:
            eng = make_engine(name, self._settings, self._model_dir, self._stages, self._spawner)
            await eng.start()
            self._stack.push_async_callback(eng.stop)
            self._by_name[name] = eng
        return self._by_name[name]

    async def started(self) -> None:
        await asyncio.gather(*(e.started() for e in self._by_name.values() if hasattr(e, "started")))
