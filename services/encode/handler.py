"""encode: pull pixels over NIXL, run the vision encoder (batched across messages), keep the
embeddings in this worker's pool and send their descriptors on to prefill.

In: ``EncodeRequest``. Out: ``PrefillRequest`` on ``mm.prefill``; media-fetch's pixel slots are
released once produced. With the embedding cache (``cache`` given, items with a ``cache_key``)
each item goes through :class:`~shared.embcache.coalesce.EncodeCache`: served from a pool that
holds it (this worker's or another's: ``owners`` names every agent), one encode for concurrent
requests, pixels pulled only for items encoded. ``EncodeRequest.cached`` items pass as they are;
so do raw-media items (``raw_kinds``: the LM engine's own encoder takes them, docs/design/vllm-engine.md).
Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

from shared import protocol
from shared.embcache.coalesce import EncodeCache, count_uncached_encode
from shared.engines.base import Engine
from shared.keys import TOPIC_PREFILL
from shared.process.aio import gather
from shared.stage import Context, Outcome, Produce
from shared.tracing import timed_transfer

Owned = tuple[protocol.AgentRef, protocol.EmbeddingItem]


class EncodeHandler:
    def __init__(self, engine: Engine | None, cache: EncodeCache | None = None, router=None,
                 raw_kinds: frozenset[str] = frozenset()) -> None:
        self._engine = engine  # concurrent encode() calls are batched by the engine; None: raw kinds only
        self._cache = cache
        self._router = router  # shared.kv.router.Router: reads the routing table beside the encoder
        # kinds the LM engine takes as raw media (shared.models.registry.raw_modalities): passed on as they came
        self._raw = raw_kinds

    async def _encode(self, pixels, item: protocol.PixelItem):
        if item.kind.endswith("_embeds") or item.kind in self._raw:  # precomputed, or raw for the LM: no encoder
            return pixels
        if self._engine is None:
            raise RuntimeError(f"this encode stage has no encoder for {item.kind} items")
        return await self._engine.encode(pixels, item.grid_thw, item.n_tokens, item.kind, item.meta)

    async def handle(self, msg: protocol.EncodeRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        if self._router is not None:  # the PrefillRequest's route, read while the items encode
            self._router.read_ahead(msg.meta.request_id, msg.meta.prompt_token_ids, [*msg.items, *msg.cached],
                                    salt=msg.meta.cache_scope)
        results = await gather(*(self._item(msg, it, ctx) for it in msg.items), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for r in results:  # nobody will read these: end their leases now, not at TTL
                if not isinstance(r, BaseException) and r[1].embeds.agent == ctx.transfer.name and r[1].embeds.lease:
                    ctx.transfer.free_local(r[1].embeds.lease)
            raise failed
        # the items media-fetch found in the index go on untouched (prefill validates them)
        owners = {o.name: o for o in msg.cached_owners} | {owner.name: owner for owner, _ in results}
        items = sorted([*(item for _, item in results), *msg.cached], key=lambda it: it.index)
        out = protocol.PrefillRequest(meta=msg.meta, owners=tuple(owners.values()), items=tuple(items))
        return Outcome([Produce(TOPIC_PREFILL, msg.meta.request_id, out)],
                       [(msg.owner, [it.pixels.lease for it in msg.items])])

    async def _item(self, msg: protocol.EncodeRequest, it: protocol.PixelItem, ctx: Context) -> Owned:
        async def encode() -> protocol.TensorRef:
            with timed_transfer():
                pixels = await ctx.transfer.get(msg.owner, it.pixels)
            emb = await self._encode(pixels, it)
            if it.kind not in self._raw and emb.shape[0] != it.n_tokens:
                raise RuntimeError(f"encoder gave {emb.shape[0]} rows for {it.n_tokens} tokens")
            with timed_transfer():
                return await ctx.transfer.put_wait(emb, timeout_ms=5_000)

        if self._cache is not None and it.cache_key:
            return await self._cache.embed(it, encode, fleet_ok=msg.meta.attempt == 0,
                                           deadline_unix_ms=msg.meta.deadline_unix_ms)
        ref = await encode()
        count_uncached_encode()
        return ctx.transfer.ref(), protocol.EmbeddingItem(index=it.index, mm_hash=it.mm_hash, grid_thw=it.grid_thw,
                                                          n_tokens=it.n_tokens, embeds=ref,
                                                          kind=it.kind.removesuffix("_embeds"), meta=it.meta,
                                                          second_per_grid_t=it.second_per_grid_t)
