"""An encode worker's embedding cache (:class:`EmbeddingStore`): pinned slots of its NIXL pool,
LRU, bounded in bytes, publishing and deleting its index entries as it inserts and evicts. An
entry is deleted from the index BEFORE its slot is unpinned, so a reader validating against the
index never accepts a reused slot. Single event loop; not thread-safe.

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from dataclasses import dataclass

import msgspec

from shared import protocol
from shared.embcache.index import EmbeddingIndex
from shared.embcache.metrics import EVICTIONS, POOL_BYTES
from shared.transfer import TransferAgent

log = logging.getLogger(__name__)


@dataclass
class Cached:
    key: str
    ref: protocol.TensorRef  # the pinned slot, ``lease == 0``
    grid_thw: tuple[int, int, int]
    n_tokens: int
    gen: int
    published_at: float = 0.0  # monotonic; 0: not in the index
    meta: tuple[int, ...] = ()  # the item's other geometry (``PixelItem.meta``, ``second_per_grid_t``)
    second_per_grid_t: float = 0.0


class EmbeddingStore:
    """- ``insert`` pins the slot of a freshly put embedding (the put's own lease goes to the
      request's consumer as usual; its release ends only that lease) and publishes the index
      entry. Items above ``max_item_fraction`` of the capacity are refused (returns None).
    - Eviction (least recently used first, to make room) deletes the index entry first and only
      then unpins. When that delete fails (Redis down), the slot stays pinned and its bytes stay
      counted; the delete is retried on later inserts, and meanwhile inserts that do not fit are
      refused.
    - ``lease`` hands one more consumer its own lease on a cached slot (``TransferAgent.share``).
    - ``close`` deletes every entry this worker published (a clean stop); a crash leaves them to
      their TTL, the owner-liveness check and readers' fallbacks."""

    def __init__(self, agent: TransferAgent, index: EmbeddingIndex | None, *, capacity_bytes: int,
                 max_item_fraction: float) -> None:
        self._agent = agent
        self._index = index
        self.capacity_bytes = capacity_bytes
        self.max_item_bytes = int(capacity_bytes * max_item_fraction)
        self._lru: collections.OrderedDict[str, Cached] = collections.OrderedDict()
        self._stuck: list[Cached] = []  # evicted, index delete failed: still pinned
        self.bytes = 0  # pinned: the LRU's items, victims being retired, stuck ones
        self._lru_bytes = 0  # the LRU's items alone (what eviction can free), kept as they come and go

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: str) -> Cached | None:
        c = self._lru.get(key)
        if c is not None:
            self._lru.move_to_end(key)
        return c

    def lease(self, c: Cached) -> protocol.TensorRef:
        return self._agent.share(c.ref)

    def entry(self, c: Cached) -> protocol.EmbeddingIndexEntry:
        return protocol.EmbeddingIndexEntry(owner=self._agent.ref(), embeds=c.ref, grid_thw=c.grid_thw,
                                            n_tokens=c.n_tokens, gen=c.gen, created_unix_ms=int(time.time() * 1000),
                                            meta=c.meta, second_per_grid_t=c.second_per_grid_t)

    async def republish_if_old(self, c: Cached) -> None:
        """Refresh the index entry of a local hit once half its TTL has passed (or if it was
        never published, e.g. Redis was down): a hot item stays findable fleet-wide."""
        if self._index is None:
            return
        if c.published_at and time.monotonic() - c.published_at < self._index.ttl_s / 2:
            return
        if await self._index.publish(c.key, self.entry(c)):
            c.published_at = time.monotonic()

    async def insert(self, key: str, ref: protocol.TensorRef, grid_thw: tuple[int, int, int],
                     n_tokens: int, *, publish: bool = True, meta: tuple[int, ...] = (),
                     second_per_grid_t: float = 0.0) -> Cached | None:
        """Cache the embedding in ``ref`` (this agent's slot, its put lease still live);
        ``publish=False`` leaves the index entry to a later ``publish`` (off the hot path)."""
        if key in self._lru:
            return self.get(key)
        n = ref.nbytes
        if n > self.max_item_bytes:
            return None
        await self._retry_stuck()
        # a running total, not a sum over the LRU: that took 0.13 ms an insert at 2000 items (a
        # full 64 MiB cache of the tiny model's embeddings), 0.55 ms at 8000, on the encode loop
        if self.bytes - self._lru_bytes + n > self.capacity_bytes:
            return None  # the bytes of failed evictions block it; never go over the bound
        victims, leaving = [], 0
        while self.bytes - leaving + n > self.capacity_bytes:
            victims.append(self._lru.popitem(last=False)[1])
            leaving += victims[-1].ref.nbytes
        self._lru_bytes -= leaving
        self._agent.pin(ref)
        c = Cached(key, msgspec.structs.replace(ref, lease=0), grid_thw, n_tokens, secrets.randbits(62) + 1,
                   meta=tuple(meta), second_per_grid_t=second_per_grid_t)
        self._lru[key] = c
        self._lru_bytes += n
        self.bytes += n
        for v in victims:
            await self._retire(v)
        self._gauge()
        if publish:
            await self.publish(c)
        return c

    async def publish(self, c: Cached) -> None:
        """Write ``c``'s index entry (unless it was evicted meanwhile)."""
        entry = self.publishable(c)
        if entry is not None and await self._index.publish(c.key, entry):
            c.published_at = time.monotonic()

    def publishable(self, c: Cached) -> protocol.EmbeddingIndexEntry | None:
        """``c``'s index entry, or None when there is no index or ``c`` was evicted meanwhile."""
        return self.entry(c) if self._index is not None and self._lru.get(c.key) is c else None

    async def close(self) -> None:
        """Delete every index entry of this cache and unpin everything."""
        for c in list(self._lru.values()) + self._stuck:
            if self._index is not None:
                await self._index.delete(c.key, c.gen)
            self._agent.unpin(c.ref)
        self._lru.clear()
        self._stuck.clear()
        self.bytes = self._lru_bytes = 0
        self._gauge()

    async def _retire(self, c: Cached) -> None:
        if self._index is not None and not await self._index.delete(c.key, c.gen):
            self._stuck.append(c)
            return
        self._agent.unpin(c.ref)  # freed now, or when the last consumer's lease ends
        self.bytes -= c.ref.nbytes
        EVICTIONS.labels(cache="encode").inc()

    async def _retry_stuck(self) -> None:
        stuck, self._stuck = self._stuck, []
        for c in stuck:
            await self._retire(c)

    def _gauge(self) -> None:
        POOL_BYTES.labels(cache="encode").set(self.bytes)
