"""The encode stage: its topic, its message and how a worker builds its handler.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import logging

from shared import protocol
from shared.keys import TOPIC_ENCODE, TOPIC_PREFILL
from shared.models.registry import family_of, raw_modalities, served_modalities
from shared.stage import StageBuild, StageParts, StageSpec

log = logging.getLogger(__name__)


async def build(parts: StageParts) -> StageBuild:
    from services.encode.handler import EncodeHandler

    settings = parts.settings
    cache = None
    if parts.index is not None:
        from shared.embcache.coalesce import EncodeCache
        from shared.embcache.store import EmbeddingStore

        # the pool also holds every in-flight tensor: the cache may pin at most half of it
        capacity = min(settings.embedding_cache_bytes, settings.pool_bytes // 2)
        if capacity < settings.embedding_cache_bytes:
            log.warning("embedding_cache_bytes %d exceeds half of pool_bytes %d: caching %d bytes",
                        settings.embedding_cache_bytes, settings.pool_bytes, capacity)
        store = EmbeddingStore(parts.transfer, parts.index, capacity_bytes=capacity,
                               max_item_fraction=settings.embedding_cache_max_item_fraction)
        parts.stack.push_async_callback(store.close)  # runs before the agent stops: entries go first
        cache = EncodeCache(store, parts.index, parts.transfer, parts.worker_id,
                            wait_ms=settings.embedding_coalesce_wait_ms)
        parts.stack.push_async_callback(cache.drain)  # runs before store.close
    # the PrefillRequest is routed where it goes to Kafka, i.e. unless this worker runs prefill too
    router = None if "prefill" in parts.stages else parts.router
    # the LM engine's raw-media kinds pass through; served only those, this stage loads no encoder
    family = family_of(parts.model_dir)
    raw = raw_modalities(family, settings.engine)
    engine = await parts.engine("transformers") if served_modalities(family, settings.engine) - raw else None
    if raw:
        log.info("encode passes %s %s items through unencoded (raw media for the %s engine)%s", family.name,
                 ", ".join(sorted(raw)), settings.engine, "; no encoder loaded" if engine is None else "")
    return StageBuild(EncodeHandler(engine, cache, router=router, raw_kinds=raw))  # the vision encoder


# only media-fetch feeds it: a worker running both hands items over in memory, never via mm.encode
SPEC = StageSpec(name="encode", topic=TOPIC_ENCODE, message=protocol.EncodeRequest, produces=(TOPIC_PREFILL,),
                 part="e", build=build, upstream="media-fetch")
