"""The prefill stage: its topic, its message and how a worker builds its handler.

Apart from decode it exports KV (``services.prefill.handler``) and keeps its row of the KV-aware
routing table: its load and partitions (``LoadReporter``, also the runner's rebalance listener)
and, with a prefix cache, its blocks and route notes (``TableWriter``). With decode in the
same worker it generates (``services.prefill.generate``) under ``decode_concurrency``.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import socket

from shared import protocol
from shared.keys import TOPIC_DECODE, TOPIC_PREFILL
from shared.stage import StageBuild, StageParts, StageSpec


async def build(parts: StageParts) -> StageBuild:
    from shared.embcache.pull import EmbeddingPuller
    from shared.embcache.recent import RecentEmbeddings

    settings = parts.settings
    recent = RecentEmbeddings(settings.prefill_embedding_cache_bytes) \
        if parts.index is not None and settings.prefill_embedding_cache_bytes > 0 else None
    puller = EmbeddingPuller(parts.index, recent)
    lm = await parts.engine(settings.engine)
    if "decode" in parts.stages:
        from services.prefill.generate import GenerateHandler

        return StageBuild(GenerateHandler(lm, puller), concurrency=settings.decode_concurrency)
    from services.prefill.handler import PrefillHandler
    from shared.engines.registry import engine_capabilities
    from shared.kv.audit import RouteAudit
    from shared.kv.prefix_cache import PrefixCache
    from shared.kv.reuse import EngineCacheReport, PrefixReuse
    from shared.kv.table import LoadReporter, LoadTracker, TableWriter
    from shared.models.registry import placeholder_token_id

    load = LoadTracker()
    # the metric label leaves out pid and random suffix: a restart continues the same series
    # (processes on one host are told apart by the scrape target, Prometheus' `instance`)
    label = f"{'+'.join(parts.stages)}@{socket.gethostname()}"
    placeholder = placeholder_token_id(parts.model_dir)
    caps = engine_capabilities(settings.engine)
    reuse = PrefixReuse(PrefixCache(settings.prefix_cache_bytes, settings.kv_block_size), placeholder,
                        metric_label=label) \
        if caps.prefix_kv and settings.prefix_cache_bytes > 0 else None
    # an engine with its own prefix cache (vLLM) reports it in the same block keys
    engine_cache = EngineCacheReport(placeholder, settings.kv_block_size, metric_label=label) \
        if caps.kv_events else None
    reporter = LoadReporter(parts.redis, parts.keys, parts.worker_id, load, settings)
    if reuse is None and engine_cache is None:
        return StageBuild(PrefillHandler(lm, None, load, puller), listener=reporter, background=(reporter.run,))
    table = TableWriter(parts.redis, parts.keys, parts.worker_id, settings)
    handler = PrefillHandler(lm, reuse, load, puller, RouteAudit(table, parts.keys), engine_cache, table)
    return StageBuild(handler, listener=reporter, background=(reporter.run, table.run))


# work enters here from media-fetch, encode and (text-only requests) the gateway
SPEC = StageSpec(name="prefill", topic=TOPIC_PREFILL, message=protocol.PrefillRequest,
                 produces=(TOPIC_DECODE,), part="p", build=build)
