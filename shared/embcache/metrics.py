"""Prometheus series of the embedding cache (default registry; every process's ``/metrics``
exposes them). ``stage`` is the stage that counted; ``source`` of a hit: ``local`` (this
encode worker's pool), ``index`` (another worker's pool, found in Redis), ``prefill``
(prefill's own recent copy, no pull); ``modality``: the item's (image / video / audio).

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

# ``modality``: shared.metrics.modality_of the item's kind (image / video / audio)
HITS = Counter("mmfleet_embedding_cache_hits_total", "Media items whose embedding was reused",
               ["stage", "source", "modality"])
MISSES = Counter("mmfleet_embedding_cache_misses_total", "Media items with no reusable embedding",
                 ["stage", "modality"])
ENCODER_ITEMS = Counter("mmfleet_encoder_items_total", "Media items run through an encoder forward")
POOL_BYTES = Gauge("mmfleet_embedding_pool_bytes", "Bytes of embeddings held by a cache", ["cache"])
COALESCED = Counter("mmfleet_embedding_coalesced_waits_total",
                    "Requests that waited for another request's encode of the same item instead of "
                    "encoding it", ["scope", "result"])
EVICTIONS = Counter("mmfleet_embedding_cache_evictions_total", "Embeddings evicted from a cache", ["cache"])
FALLBACKS = Counter("mmfleet_embedding_cache_fallbacks_total",
                    "Cached embeddings that could not be used (owner gone, evicted, Redis error): "
                    "the item was encoded again", ["stage", "reason"])
