"""media-fetch: load each item's bytes, hash them, decode under the media policy, preprocess to
pixels, and hand the pixels to encode by NIXL descriptor.

In: ``MediaFetchRequest`` (items are http(s) URLs, or inline bytes held by the gateway).
Out: one ``EncodeRequest`` on ``mm.encode``; releases the gateway's inline slots once produced.
Bad media ends the request with a 400/413/422 (``RequestFailed``); the worker goes on.
mm_hash = BLAKE3 of the raw fetched bytes, so identical content hashes the same wherever it
came from.
"""

from __future__ import annotations

from collections.abc import Callable

import blake3

from shared import protocol
from shared.tracing import timed_transfer
from shared.compute import ComputeLane
from shared.keys import TOPIC_ENCODE
from shared.media.fetch import MediaFetcher
from shared.media.images import decode_image
from shared.media.sources import MediaError
from shared.settings import Settings
from shared.stage import Context, Outcome, Produce, RequestFailed

# image -> object with pixel_values (float32 [n_patches, patch_dim]), grid_thw, n_tokens
Preprocess = Callable[[object], object]


class MediaFetchHandler:
    def __init__(self, settings: Settings, fetcher: MediaFetcher, preprocess: Preprocess, lane: ComputeLane) -> None:
        self._s = settings
        self._fetcher = fetcher
        self._preprocess = preprocess
        self._lane = lane

    async def handle(self, msg: protocol.MediaFetchRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        inline_leases = [it.inline.lease for it in msg.items if it.inline is not None]
        releases = [(msg.owner, inline_leases)] if msg.owner is not None and inline_leases else []
        items: list[protocol.PixelItem] = []
        try:
            for index, src in enumerate(msg.items):
                with timed_transfer():
                    raw = await self._load(src, msg.owner, ctx)
                mm_hash = blake3.blake3(raw).hexdigest()
                px = await self._lane.run(self._decode, raw, src.param)
                with timed_transfer():
                    ref = await ctx.transfer.put_wait(px.pixel_values, timeout_ms=5_000)
                items.append(protocol.PixelItem(index=index, mm_hash=mm_hash, grid_thw=px.grid_thw,
                                                n_tokens=px.n_tokens, pixels=ref))
        except BaseException as exc:
            for item in items:  # nobody will read these slots: free them now, not at TTL
                ctx.transfer.free_local(item.pixels.lease)
            if isinstance(exc, MediaError):
                for owner, leases in releases:  # the request is over: the gateway may free its bytes
                    await ctx.transfer.release(owner, leases)
                raise RequestFailed(exc.status, str(exc), param=_param_of(msg, exc), code=exc.code) from None
            raise
        out = protocol.EncodeRequest(meta=msg.meta, owner=ctx.transfer.ref(), items=tuple(items))
        return Outcome([Produce(TOPIC_ENCODE, msg.meta.request_id, out)], releases)

    async def _load(self, src: protocol.MediaSource, owner: protocol.AgentRef | None, ctx: Context) -> bytes:
        if src.inline is not None:
            if owner is None:
                raise MediaError(f"{src.param}: inline media without an owning agent")
            data = await ctx.transfer.get(owner, src.inline)
            return data.numpy().tobytes()
        return await self._fetcher.fetch(src.url, max_bytes=self._s.max_image_bytes, param=src.param)

    def _decode(self, raw: bytes, param: str):
        img = decode_image(raw, max_pixels=self._s.max_image_pixels, param=param)
        return self._preprocess(img)


def _param_of(msg: protocol.MediaFetchRequest, exc: MediaError) -> str | None:
    text = str(exc)
    return next((it.param for it in msg.items if text.startswith(it.param)), None)
