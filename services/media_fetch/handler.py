"""media-fetch: load each item's bytes, hash them (mm_hash = BLAKE3 of the raw bytes), decode
under the media policy, preprocess to pixels, and hand the pixels to encode by NIXL descriptor.

In: ``MediaFetchRequest`` (http(s), ``file://`` under ``media_file_root``, or inline bytes the
gateway holds until the request ends). Out: one ``EncodeRequest`` on ``mm.encode``; bad media
ends the request with a 400/413. Decoding follows ``kind``: image, video (frames sampled; the
sampling is part of its mm_hash), audio. With the embedding cache, a first attempt's items with
a live index entry are not decoded: their descriptors ride in ``EncodeRequest.cached``, or the
request goes straight to ``mm.prefill`` when all hit. An item the client named (``uuid``) is
hashed by its name in the request's cache scope and looked up before it is loaded (a hit needs
no bytes); one without data that the index does not hold is a 400. Design: docs/guide/media.md.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import blake3

from shared import metrics, protocol
from shared.embcache.identity import cache_key, named_hash, source_options
from shared.embcache.index import EmbeddingIndex
from shared.embcache.metrics import HITS, MISSES
from shared.keys import TOPIC_ENCODE, TOPIC_PREFILL
from shared.media.audio import decode_audio
from shared.media.cache import FetchCache
from shared.media.fetch import MediaFetcher
from shared.media.files import load_file
from shared.media.images import decode_image
from shared.media.sources import REMOTE_SCHEMES, MediaError, scheme_of
from shared.media.video import VideoLimits, decode_video_clip
from shared.process.aio import gather
from shared.process.compute import ComputeLane
from shared.settings import Settings
from shared.stage import Context, Outcome, Produce, RequestFailed
from shared.tracing import timed_transfer

# image (PIL) or video (uint8 [frames, h, w, 3]) -> object with pixel_values (float32
# [n_patches, patch_dim]), grid_thw, n_tokens
Preprocess = Callable[[object], object]


class MediaFetchHandler:
    def __init__(self, settings: Settings, fetcher: MediaFetcher, preprocess: Preprocess | None, lane: ComputeLane, *,
                 preprocess_video: Preprocess | None = None, preprocess_audio: Preprocess | None = None,
                 embeds_hidden_size: int = 0, index: EmbeddingIndex | None = None, fingerprint: str = "",
                 index_shortcut_kinds: frozenset[str] = frozenset({"image", "video"}),
                 encode_here: bool = False, raw_kinds: frozenset[str] = frozenset()) -> None:
        self._s = settings
        # kinds the LM engine takes as raw media (registry.raw_modalities): nothing of ours encodes
        # them, so they have no embedding-cache key and no precomputed-embeddings form
        self._raw = raw_kinds
        # encode runs in this process (its message handed over in memory): it may read the
        # pixels put here as they are, without copying them out of the pool
        self._encode_here = encode_here
        self._lease_ids = itertools.count()  # encode leases this worker takes (holder ids)
        # kinds whose whole geometry an index entry holds: a request of only such items, all
        # cached, skips encode (Qwen2.5-VL's video time step is not in the entry: not its videos)
        self._shortcut_kinds = index_shortcut_kinds
        self._index = index
        self._fingerprint = fingerprint
        self._fetcher = fetcher
        self._preprocess = preprocess
        self._preprocess_video = preprocess_video
        # audio: float32 mono samples at ``preprocess_audio.sampling_rate`` -> features
        self._preprocess_audio = preprocess_audio
        self._lane = lane
        self.cache = FetchCache(settings.media_cache_bytes, ttl_s=settings.media_cache_ttl_s)
        self._video_limits = VideoLimits(max_duration_s=settings.max_video_duration_s,
                                         max_frames=settings.max_video_frames, max_side=settings.max_video_side,
                                         max_decoded_frames=settings.max_video_decoded_frames,
                                         max_pixels=settings.max_video_pixels)
        # the gateway's bound on a request's min/max_pixels, checked again for records that did not
        # pass it; a preprocessor without ``token_pixels`` takes no pixel budget at all (bound 0)
        token_pixels = int(getattr(preprocess, "token_pixels", 0))
        self._max_request_pixels = min(settings.max_image_pixels, settings.max_image_tokens * token_pixels)
        # kind -> (byte cap, decoder run on the compute lane: (raw, source) -> preprocessed)
        self._kinds: dict[str, tuple[int, Callable[[bytes, protocol.MediaSource], object]]] = {}
        if preprocess is not None:
            self._kinds["image"] = (settings.max_image_bytes, self._decode_image)
        if preprocess_video is not None:
            self._kinds["video"] = (settings.max_video_bytes, self._decode_video)
        if preprocess_audio is not None:
            self._kinds["audio"] = (settings.max_audio_bytes, self._decode_audio)
        self._embeds_hidden = embeds_hidden_size
        if embeds_hidden_size:  # precomputed embeddings of each modality served: passed through by encode
            # the gateway's float32 .npy of a payload within max_embeds_bytes (16-bit payloads widen x2)
            embeds_cap = 2 * settings.max_embeds_bytes + 4096
            for modality in [k for k in self._kinds if k in ("image", "video", "audio")]:
                self._kinds[f"{modality}_embeds"] = (embeds_cap, self._decode_embeds)
        for modality in raw_kinds:
            self._kinds.pop(f"{modality}_embeds", None)

    async def handle(self, msg: protocol.MediaFetchRequest, ctx: Context) -> Outcome:
        assert ctx.transfer is not None
        for src in msg.items:
            self._check_pixel_budget(src)
        raws: list[bytes | None] = [None] * len(msg.items)
        await self._load_all(msg, ctx, raws, [i for i, src in enumerate(msg.items) if not src.uuid])
        hashes = [self._mm_hash(raw, src, msg.meta.cache_scope) for raw, src in zip(raws, msg.items, strict=True)]
        keys = [cache_key(self._fingerprint, h, src.kind)
                if self._fingerprint and not src.kind.endswith("_embeds") and src.kind not in self._raw
                else "" for h, src in zip(hashes, msg.items, strict=True)]
        cached, leases = await self._cached(msg, hashes, keys, ctx.worker_id)
        owners = tuple({e.owner.name: e.owner for e in cached.values()}.values())
        hits = tuple(self._hit_item(i, hashes[i], keys[i], msg.items[i], e) for i, e in sorted(cached.items()))
        if cached and len(cached) == len(msg.items):
            return Outcome([Produce(TOPIC_PREFILL, msg.meta.request_id,
                                    protocol.PrefillRequest(meta=msg.meta, owners=owners, items=hits))])
        items: list[protocol.PixelItem] = []
        handed_over = False
        try:
            await self._load_named(msg, ctx, raws, cached)
            for index, (src, raw) in enumerate(zip(msg.items, raws, strict=True)):
                if index in cached:
                    continue
                _, decode = self._kind(src)
                px = await self._lane.run(decode, raw, src, size=len(raw))
                self._check_fits_pool(px, src)
                with timed_transfer():
                    ref = await ctx.transfer.put_wait(px.pixel_values, timeout_ms=5_000,
                                                      keep_source=self._encode_here)
                items.append(protocol.PixelItem(index=index, mm_hash=hashes[index], grid_thw=px.grid_thw,
                                                n_tokens=px.n_tokens, pixels=ref, cache_key=keys[index],
                                                kind=src.kind, meta=tuple(getattr(px, "meta", ())),
                                                second_per_grid_t=float(getattr(px, "second_per_grid_t", 0.0)),
                                                lease_holder=leases.get(index, "")))
            out = protocol.EncodeRequest(meta=msg.meta, owner=ctx.transfer.ref(), items=tuple(items), cached=hits,
                                         cached_owners=owners)
            handed_over = True
        except BaseException as exc:
            for item in items:  # nobody will read these slots: free them now, not at TTL
                ctx.transfer.free_local(item.pixels.lease)
            if isinstance(exc, MediaError):
                raise RequestFailed(exc.status, str(exc), param=_param_of(msg, exc), code=exc.code) from None
            raise
        finally:
            if not handed_over and leases:  # nobody will encode under them: others need not wait for the TTL
                await gather(*(self._index.release_lease(keys[i], h) for i, h in leases.items()))
        first = items[0].index if items else 0
        route = (keys[first] or hashes[first]) if items else msg.meta.request_id
        return Outcome([Produce(TOPIC_ENCODE, route, out)])

    async def _cached(self, msg: protocol.MediaFetchRequest, hashes: list[str], keys: list[str], worker_id: str
                      ) -> tuple[dict[int, protocol.EmbeddingIndexEntry], dict[int, str]]:
        """(item index -> its live index entry, for the items that need no decode; item index ->
        the encode lease taken for it). Only images and videos (their geometry is in the entry;
        audio items carry encoder meta). With encode in this worker, each lookup also takes the
        item's encode lease in the same round trip (``lookup_or_lease``): encode then needs no
        round trip of its own before it starts (``PixelItem.lease_holder``)."""
        if self._index is None:
            return {}, {}
        # a named item is looked up whatever its kind (its entry holds all its geometry) and on a
        # restart too (without data it has no other way in)
        wanted = [i for i, (k, src) in enumerate(zip(keys, msg.items, strict=True))
                  if k and (src.uuid or (src.kind in self._shortcut_kinds and msg.meta.attempt == 0))]
        leases: dict[int, str] = {}
        if self._encode_here and msg.meta.attempt == 0:
            holders = {i: f"{worker_id}#m{next(self._lease_ids)}" for i in wanted}
            answers = await gather(*(self._index.lookup_or_lease(keys[i], holders[i]) for i in wanted))
            entries = [entry for entry, _ in answers]
            leases = {i: holders[i] for i, (entry, leased) in zip(wanted, answers, strict=True)
                      if entry is None and leased}
        else:
            entries = await gather(*(self._index.lookup_live(keys[i]) for i in wanted))
        found = {i: e for i, e in zip(wanted, entries, strict=True) if e is not None}
        for i in wanted:
            modality = metrics.modality_of(msg.items[i].kind)
            if i in found:
                HITS.labels(stage="media-fetch", source="index", modality=modality).inc()
            else:
                MISSES.labels(stage="media-fetch", modality=modality).inc()
        return found, leases

    @staticmethod
    def _hit_item(index: int, mm_hash: str, key: str, src: protocol.MediaSource,
                  e: protocol.EmbeddingIndexEntry) -> protocol.EmbeddingItem:
        return protocol.EmbeddingItem(index=index, mm_hash=mm_hash, grid_thw=e.grid_thw, n_tokens=e.n_tokens,
                                      embeds=e.embeds, cache_key=key, cache_gen=e.gen, kind=src.kind, meta=e.meta,
                                      second_per_grid_t=e.second_per_grid_t)

    async def _load_all(self, msg: protocol.MediaFetchRequest, ctx: Context, raws: list[bytes | None],
                        indices: list[int]) -> None:
        """Load the bytes of the items at ``indices`` into ``raws``; bad media is a ``RequestFailed``."""
        try:
            for i in indices:
                src = msg.items[i]
                max_bytes, _ = self._kind(src)
                with timed_transfer():
                    raws[i] = await self._load(src, max_bytes, msg.owner, ctx)
        except MediaError as exc:
            raise RequestFailed(exc.status, str(exc), param=_param_of(msg, exc), code=exc.code) from None

    async def _load_named(self, msg: protocol.MediaFetchRequest, ctx: Context, raws: list[bytes | None],
                          cached: dict[int, protocol.EmbeddingIndexEntry]) -> None:
        """The bytes of the named items the index did not hold: loaded when the request carries
        them; without them, the item's entry went (evicted, its owner gone) after the gateway
        found it: a 400 that says so, for the client to send the data again."""
        missed = [i for i, src in enumerate(msg.items) if src.uuid and i not in cached]
        for i in missed:
            src = msg.items[i]
            if not src.url and src.inline is None:
                raise RequestFailed(400, f"{src.param}: the {src.kind} named {src.uuid!r} is no longer cached "
                                         "(evicted since this request was admitted); send its data with the uuid",
                                    param=src.param, code="unknown_media_uuid")
        await self._load_all(msg, ctx, raws, missed)

    def _check_pixel_budget(self, src: protocol.MediaSource) -> None:
        """A min/max_pixels beyond ``max_image_tokens`` worth of pixels is a 400 before any fetch:
        min_pixels scales even a 1x1 image up to it."""
        limit = self._max_request_pixels
        for name, value in (("min_pixels", src.min_pixels), ("max_pixels", src.max_pixels)):
            if not 0 <= value <= limit:
                why = (f"must be from 0 to {limit} pixels (at most {self._s.max_image_tokens} image tokens)" if limit
                       else "is not taken by this model's image processor")
                raise RequestFailed.bad_request(f"{src.param}: mm_processor_kwargs.{name} {why}; got {value}",
                                                param=f"mm_processor_kwargs.{name}")

    def _check_fits_pool(self, px, src: protocol.MediaSource) -> None:
        """A tensor larger than the whole pool can never be placed: a 413, not a fault to retry."""
        nbytes = px.pixel_values.numel() * px.pixel_values.element_size()
        if nbytes > self._s.pool_bytes:
            raise MediaError(f"{src.param}: the {src.kind} becomes {nbytes} bytes of model input, above the "
                             f"{self._s.pool_bytes} byte tensor pool; send a smaller {src.kind}", status=413,
                             code="media_too_large")

    def _kind(self, src: protocol.MediaSource) -> tuple[int, Callable[[bytes, str], object]]:
        entry = self._kinds.get(src.kind)
        if entry is None:
            raise MediaError(f"{src.param}: {src.kind} media is not supported by this server", status=400,
                             code="unsupported_modality")
        return entry

    async def _load(self, src: protocol.MediaSource, max_bytes: int, owner: protocol.AgentRef | None,
                    ctx: Context) -> bytes:
        source = "inline" if src.inline is not None else ("file" if scheme_of(src.url) == "file" else "http")
        t0 = time.perf_counter()
        raw = await self._load_bytes(src, max_bytes, owner, ctx)
        metrics.MEDIA_FETCH.labels(source).observe(time.perf_counter() - t0)
        metrics.MEDIA_FETCH_BYTES.labels(source, metrics.modality_of(src.kind)).inc(len(raw))
        return raw

    async def _load_bytes(self, src: protocol.MediaSource, max_bytes: int, owner: protocol.AgentRef | None,
                          ctx: Context) -> bytes:
        if src.inline is not None:
            if owner is None:
                raise MediaError(f"{src.param}: inline media without an owning agent")
            if src.inline.nbytes > max_bytes:
                raise MediaError(f"{src.param}: media is {src.inline.nbytes} bytes, above the {max_bytes} byte limit",
                                 status=413, code="media_too_large")
            data = await ctx.transfer.get(owner, src.inline)
            return data.numpy().tobytes()
        url = src.url
        scheme = scheme_of(url)
        try:
            if scheme in REMOTE_SCHEMES:
                return await self.cache.get_or_fetch(
                    (url, max_bytes), lambda: self._fetcher.fetch_bytes(url, max_bytes=max_bytes))
            if scheme == "file":
                return await asyncio.to_thread(load_file, url, root=self._s.media_file_root, max_bytes=max_bytes)
            raise MediaError(f"unsupported URL scheme {scheme!r}; use https://, http:// or a data: URL")
        except MediaError as exc:
            raise exc.for_param(src.param) from None

    def _sampling(self, src: protocol.MediaSource) -> tuple[int, float]:
        """(num_frames, fps) for a video: the request's, else the server's defaults."""
        if src.num_frames > 0 or src.fps > 0:
            return src.num_frames, src.fps
        if self._s.video_fps > 0:
            return 0, self._s.video_fps
        return self._s.video_num_frames, 0.0

    def _mm_hash(self, raw: bytes | None, src: protocol.MediaSource, scope: str) -> str:
        """The item's hash: of its name when the client named it, else of its bytes; in both, the
        processing options that change what it becomes, and the request's cache scope."""
        if src.uuid:
            return named_hash(src.kind, src.uuid, scope, source_options(src.min_pixels, src.max_pixels,
                                                                        src.num_frames, src.fps))
        h = blake3.blake3(raw)
        if scope:  # another tenant's (or salt's) request never shares an item hash with this one
            h.update(f"|scope:{scope}".encode())
        if src.kind.endswith("_embeds"):  # embeddings are never the same input as media's bytes
            h.update(f"|{src.kind}:{src.mime}:{src.grid_thw}:{src.second_per_grid_t:g}".encode())
        if src.kind == "image" and (src.min_pixels or src.max_pixels):  # resized differently: another input
            h.update(f"|pixels:{src.min_pixels}:{src.max_pixels}".encode())
        if src.kind == "video":  # the same bytes sampled differently are different inputs
            num_frames, fps = self._sampling(src)
            h.update(f"|video:num_frames={num_frames}:fps={fps:g}".encode())
        return h.hexdigest()

    def _decode_image(self, raw: bytes, src: protocol.MediaSource):
        param = src.param
        img = decode_image(raw, max_pixels=self._s.max_image_pixels, param=param)
        try:
            if src.min_pixels or src.max_pixels:  # the gateway allows them only where the family has them
                return self._preprocess(img, min_pixels=src.min_pixels, max_pixels=src.max_pixels)
            return self._preprocess(img)
        except ValueError as exc:  # the model's processor refuses this image (e.g. extreme aspect ratio)
            raise MediaError(f"{param}: the image cannot be processed by this model: {str(exc)[:200]}") from None

    def _decode_video(self, raw: bytes, src: protocol.MediaSource):
        num_frames, fps = self._sampling(src)
        clip = decode_video_clip(raw, num_frames=num_frames, fps=fps, limits=self._video_limits, param=src.param)
        try:  # the rate the frames were taken at: Qwen2.5-VL's time positions step by it
            return self._preprocess_video(clip.frames, fps=clip.sampled_fps)
        except ValueError as exc:  # the model's processor refuses these frames (e.g. too small)
            raise MediaError(f"{src.param}: the video cannot be processed by this model: {str(exc)[:200]}") from None

    def _decode_embeds(self, raw: bytes, src: protocol.MediaSource):
        import torch

        from shared.media.embeds import parse_embeddings

        arr = parse_embeddings(raw, fmt=src.mime, hidden_size=self._embeds_hidden, max_rows=1 << 20,
                               param=src.param)
        return _Embeds(torch.from_numpy(arr), src.grid_thw, arr.shape[0], src.second_per_grid_t)

    def _decode_audio(self, raw: bytes, src: protocol.MediaSource):
        samples = decode_audio(raw, rate_hz=int(self._preprocess_audio.sampling_rate),
                               max_duration_s=self._s.max_audio_duration_s, param=src.param)
        try:
            return self._preprocess_audio(samples)
        except ValueError as exc:
            raise MediaError(f"{src.param}: the audio cannot be processed by this model: {str(exc)[:200]}") from None


class _Embeds:
    """Precomputed embeddings in the shape of a preprocessor's output (encode passes them on)."""

    def __init__(self, values, grid_thw: tuple[int, int, int], n_tokens: int, second_per_grid_t: float) -> None:
        self.pixel_values, self.grid_thw, self.n_tokens = values, grid_thw, n_tokens
        self.second_per_grid_t = second_per_grid_t


def _param_of(msg: protocol.MediaFetchRequest, exc: MediaError) -> str | None:
    text = str(exc)
    return next((it.param for it in msg.items if text.startswith(it.param + ":")), None)
