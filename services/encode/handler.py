"""encode: pull pixels over NIXL, run the vision encoder (batched across messages), keep the
embeddings in this worker's pool and send their descriptors on to prefill.

In: ``EncodeRequest``. Out: ``PrefillRequest`` on ``mm.prefill``; releases media-fetch's pixel
slots once produced. Items of concurrent messages meet in the engine and go through
ONE encoder forward (the engine's micro-batcher).
"""

from __future__ import annotations

import asyncio

from shared import protocol
from shared.engines.base import Engine
from shared.keys import TOPIC_PREFILL
from shared.tracing import timed_transfer
from shared.stage import Context, Outcome, Produce


class EncodeHandler:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine  # concurrent encode() calls are batched by the engine

    async def _encode(self, pixels, item: protocol.PixelItem):
        if item.kind.endswith("_embeds"):  # precomputed by the client (checked at the gateway): no encoder
            return pixels
        return await self._engine.encode(pixels, item.grid_thw, item.n_tokens, item.kind, item.meta)

    async def handle(self, msg: protocol.EncodeRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        with timed_transfer():
            pixels = await asyncio.gather(*(ctx.transfer.get(msg.owner, it.pixels) for it in msg.items))
        embeds = await asyncio.gather(*(self._encode(px, it) for px, it in zip(pixels, msg.items, strict=True)))
        out_items = []
        try:
            for it, emb in zip(msg.items, embeds, strict=True):
                if emb.shape[0] != it.n_tokens:
                    raise RuntimeError(f"encoder gave {emb.shape[0]} rows for {it.n_tokens} tokens")
                with timed_transfer():
                    ref = await ctx.transfer.put_wait(emb, timeout_ms=5_000)
                out_items.append(protocol.EmbeddingItem(index=it.index, mm_hash=it.mm_hash, grid_thw=it.grid_thw,
                                                        n_tokens=it.n_tokens, embeds=ref,
                                                        kind=it.kind.removesuffix("_embeds"), meta=it.meta))
        except BaseException:
            for item in out_items:
                ctx.transfer.free_local(item.embeds.lease)
            raise
        out = protocol.PrefillRequest(meta=msg.meta, owners=(ctx.transfer.ref(),), items=tuple(out_items))
        return Outcome([Produce(TOPIC_PREFILL, msg.meta.request_id, out)],
                       [(msg.owner, [it.pixels.lease for it in msg.items])])
