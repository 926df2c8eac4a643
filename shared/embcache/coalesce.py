"""encode's path through the cache for one item (:meth:`EncodeCache.embed`): reuse this worker's
copy, wait for an encode of the same key already running here, take another encode worker's
copy from the fleet index, wait for the worker holding the key's ``SET NX PX`` lease, or encode
it once for everyone. Nothing here turns into a request error: every failure of the cache path
ends in an encode.

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from shared import protocol
from shared.embcache.index import EmbeddingIndex
from shared.embcache.metrics import COALESCED, ENCODER_ITEMS, HITS, MISSES
from shared.embcache.store import Cached, EmbeddingStore
from shared.metrics import modality_of
from shared.transfer import TransferAgent

log = logging.getLogger(__name__)

# what a local waiter gets: this worker's cache entry, a peer's index entry, or None (encode it)
_Result = Cached | protocol.EmbeddingIndexEntry | None
Owned = tuple[protocol.AgentRef, protocol.EmbeddingItem]


class EncodeCache:
    def __init__(self, store: EmbeddingStore, index: EmbeddingIndex, agent: TransferAgent, worker_id: str, *,
                 wait_ms: int, poll_ms: float = 20.0) -> None:
        self._store = store
        self._index = index
        self._agent = agent
        self._worker = worker_id
        self._wait_s = wait_ms / 1000
        self._poll_s = poll_ms / 1000
        self._inflight: dict[str, asyncio.Future[_Result]] = {}
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task] = set()  # post-encode index writes (few, short)

    async def embed(self, item: protocol.PixelItem, encode: Callable[[], Awaitable[protocol.TensorRef]], *,
                    fleet_ok: bool, deadline_unix_ms: int) -> Owned:
        """The item's embedding and its owner; ``encode`` puts a fresh one (a leased ref).

        Order: 1. this worker's cache (a new lease on the pinned slot); 2. another request of this
        worker encoding the same key right now: wait for its result; 3. (``fleet_ok``) the fleet
        index: another encode worker holds it (a lease-0 ref the reader validates after its pull);
        4. (``fleet_ok``) the lease: if another worker holds it, poll the index for its result until
        ``wait_ms`` or the request's deadline (a holder that dies lets its lease expire and the next
        waiter takes over); 5. encode, cache (pin + publish), release the lease, wake local waiters.
        An item whose lease media-fetch already took here (``PixelItem.lease_holder``) skips 3 and
        4; served by 1 or 2 instead, it frees it. ``fleet_ok`` is False for a request restarted
        after a lost tensor: only this worker's own copies and its own encode are trusted then."""
        key = item.cache_key
        taken = item.lease_holder if fleet_ok else ""  # the encode lease media-fetch took for this item
        while True:
            c = self._store.get(key)
            fut = self._inflight.get(key) if c is None else None
            if taken and (c is not None or fut is not None):  # served without encoding here: free the lease
                await self._index.release_lease(key, taken)
                taken = ""
                continue  # (that await let the store and the encodes in flight change: look again)
            if c is not None:
                HITS.labels(stage="encode", source="local", modality=modality_of(item.kind)).inc()
                await self._store.republish_if_old(c)
                return self._agent.ref(), self._item(item, self._store.lease(c))
            if fut is None:
                break
            res = await asyncio.shield(fut)
            COALESCED.labels(scope="worker", result="hit" if res is not None else "miss").inc()
            if isinstance(res, protocol.EmbeddingIndexEntry):
                return self._remote(item, res)
            if res is None:
                return await self._encode(item, encode, None)
        # this request produces the key for the worker: registered before any await, so every
        # later local request for the key waits on it
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        result: _Result = None
        try:
            holder = None
            if taken:  # the lease is ours already (media-fetch's lookup missed a moment ago): no round trip
                holder = taken
            elif fleet_ok:
                holder = f"{self._worker}#{next(self._ids)}"
                entry, leased = await self._index.lookup_or_lease(key, holder)  # one round trip
                if entry is not None:
                    HITS.labels(stage="encode", source="index", modality=modality_of(item.kind)).inc()
                    result = entry
                    return self._remote(item, entry)
                if not leased:  # another worker is encoding it: wait for its entry
                    log.debug("%s: another worker holds the encode lease; waiting for its entry", key)
                    entry, holder = await self._await_fleet(key, holder, deadline_unix_ms)
                    log.debug("%s: the wait ended with %s", key, "its entry" if entry is not None else
                              "the lease taken over" if holder is not None else "no entry (encoding it here)")
                    if entry is not None:
                        result = entry
                        return self._remote(item, entry)
            owned, result = await self._encode_and_cache(item, encode, holder)
            return owned
        finally:
            del self._inflight[key]
            fut.set_result(result)

    async def drain(self) -> None:
        """Wait for the post-encode index writes in flight (tests; shutdown before the store closes)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _await_fleet(self, key: str, holder: str, deadline_unix_ms: int
                           ) -> tuple[protocol.EmbeddingIndexEntry | None, str | None]:
        """(a peer's entry, None) or (None, our lease holder id or None when we gave up waiting)."""
        give_up = min(time.monotonic() + self._wait_s,
                      time.monotonic() + max(0.0, deadline_unix_ms / 1000 - time.time()))
        while True:
            await asyncio.sleep(self._poll_s)
            # the entry, or the lease taken over, in one atomic read: a lookup and a lease check
            # apart let the holder publish and release between them, and this worker would then
            # take the free lease and encode the item a second time
            entry, leased = await self._index.lookup_or_lease(key, holder)
            if entry is not None:
                COALESCED.labels(scope="fleet", result="hit").inc()
                return entry, None
            if leased:  # the holder failed or died (lease released or expired) with no entry
                COALESCED.labels(scope="fleet", result="took_over").inc()
                return None, holder
            if time.monotonic() > give_up:
                COALESCED.labels(scope="fleet", result="timeout").inc()
                return None, None

    async def _encode_and_cache(self, item: protocol.PixelItem, encode, holder: str | None
                                ) -> tuple[Owned, Cached | None]:
        c, ref = None, None
        try:
            MISSES.labels(stage="encode", modality=modality_of(item.kind)).inc()
            ref = await encode()
            ENCODER_ITEMS.inc()
            c = await self._store.insert(item.cache_key, ref, item.grid_thw, item.n_tokens, publish=False,
                                         meta=item.meta, second_per_grid_t=item.second_per_grid_t)
        finally:
            # index entry, then lease release (waiters poll for the entry until the lease goes),
            # then the fleet counter: none of it is needed for this request's output, so it runs
            # beside the produce instead of before it
            task = asyncio.create_task(self._after_encode(item.cache_key, c, holder, ref is not None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return (self._agent.ref(), self._item(item, ref)), c

    async def _after_encode(self, key: str, c: Cached | None, holder: str | None, encoded: bool) -> None:
        entry = self._store.publishable(c) if c is not None else None
        if await self._index.finish_encode(key, entry, holder, int(encoded)):
            c.published_at = time.monotonic()

    async def _encode(self, item: protocol.PixelItem, encode, holder: str | None) -> Owned:
        owned, _ = await self._encode_and_cache(item, encode, holder)
        return owned

    def _remote(self, item: protocol.PixelItem, entry: protocol.EmbeddingIndexEntry) -> Owned:
        return entry.owner, self._item(item, entry.embeds, entry.gen)

    @staticmethod
    def _item(item: protocol.PixelItem, ref: protocol.TensorRef, gen: int = 0) -> protocol.EmbeddingItem:
        return protocol.EmbeddingItem(index=item.index, mm_hash=item.mm_hash, grid_thw=item.grid_thw,
                                      n_tokens=item.n_tokens, embeds=ref, cache_key=item.cache_key, cache_gen=gen,
                                      kind=item.kind.removesuffix("_embeds"), meta=item.meta,
                                      second_per_grid_t=item.second_per_grid_t)


def count_uncached_encode() -> None:
    """Counts an encoder item on the uncached path (cache off, or an item without a key)."""
    ENCODER_ITEMS.inc()
