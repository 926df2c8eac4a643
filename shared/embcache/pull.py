"""prefill's side of the embedding cache: get a request's embeddings, trusting cache entries only
as far as they can be checked. Per item, in prompt order: a copy in prefill's recent LRU (by
cache key, content-addressed: always right) needs no pull; else it is pulled from its owner, and
an item found through the index (``cache_gen`` set) is validated after the pull (the entry must
still carry that generation), its entry dropped if the pull failed. A cached item that fails
either way raises :class:`OwnerGoneError`: the runner restarts the request from its source
without fleet entries, so it is encoded again (a fallback, never an error).

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

from shared import protocol
from shared.embcache.index import EmbeddingIndex
from shared.embcache.metrics import FALLBACKS, HITS
from shared.embcache.recent import RecentEmbeddings
from shared.engines.base import MediaEmbeds
from shared.metrics import modality_of
from shared.process.aio import gather
from shared.stage import Context
from shared.tracing import timed_transfer
from shared.transfer import OwnerGoneError


class EmbeddingPuller:
    def __init__(self, index: EmbeddingIndex | None = None, recent: RecentEmbeddings | None = None) -> None:
        self._index = index
        self._recent = recent

    async def pull(self, msg: protocol.PrefillRequest, ctx: Context) -> list[MediaEmbeds]:
        """The request's embeddings in prompt order."""
        owners = {o.name: o for o in msg.owners}
        items = sorted(msg.items, key=lambda it: it.index)
        with timed_transfer():
            embeds = await gather(*(self._one(owners[it.embeds.agent], it, ctx) for it in items),
                                  return_exceptions=True)
        for e in embeds:
            if isinstance(e, BaseException):
                raise e
        return [MediaEmbeds(emb, it.grid_thw, it.kind, second_per_grid_t=it.second_per_grid_t, mm_hash=it.mm_hash,
                            n_tokens=it.n_tokens) for emb, it in zip(embeds, items, strict=True)]

    async def _one(self, owner: protocol.AgentRef, it: protocol.EmbeddingItem, ctx: Context):
        key = it.cache_key
        if key and self._recent is not None:
            held = self._recent.get(key)
            if held is not None:
                HITS.labels(stage="prefill", source="prefill", modality=modality_of(it.kind)).inc()
                return held
        fleet_ref = it.cache_gen != 0 and it.embeds.agent != ctx.transfer.name
        try:
            emb = await ctx.transfer.get(owner, it.embeds)
        except OwnerGoneError:
            if fleet_ref and self._index is not None:
                FALLBACKS.labels(stage="prefill", reason="owner_gone").inc()
                await self._index.delete(key, it.cache_gen)
            raise
        if fleet_ref and (self._index is None or not await self._index.still_valid(key, it.cache_gen)):
            FALLBACKS.labels(stage="prefill", reason="evicted").inc()
            raise OwnerGoneError(f"cached embedding {key} at {owner.name} was evicted before it was read")
        if key and self._recent is not None:
            self._recent.put(key, emb)
        return emb
