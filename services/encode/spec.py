"""The encode stage: its topic, its message and how a worker builds its handler.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import logging

from shared import protocol
from shared.keys import TOPIC_ENCODE, TOPIC_PREFILL
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
    return StageBuild(EncodeHandler(await parts.engine("transformers"), cache, router=router))  # the vision encoder


# only media-fetch feeds it: a worker running both hands items over in memory, never via mm.encode
SPEC = StageSpec(name="encode", topic=TOPIC_ENCODE, message=protocol.EncodeRequest, produces=(TOPIC_PREFILL,),
                 part="e", build=build, upstream="media-fetch")
