"""media-fetch's handler with in-memory ports: loading by source (http(s), file://, inline),
de-duplication and caching of URL fetches, kind dispatch, and every media failure ending the
request with a 4xx that names the item (never a worker fault)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch

from services.media_fetch.handler import MediaFetchHandler
from shared import protocol
from shared.keys import TOPIC_ENCODE, TOPIC_PREFILL
from shared.media.fetch import MediaFetcher
from shared.process.compute import ComputeLane
from shared.settings import Settings
from shared.stage import Context, RequestFailed
from tests.fakes import ListSink, MemoryTransfer
from tests.media import samples
from tests.media.server import MediaServer


class Pixels:
    def __init__(self, img) -> None:
        self.pixel_values = torch.zeros((4, 8), dtype=torch.float32)
        self.grid_thw = (1, 2, 2)
        self.n_tokens = 1
        self.size = img.size


@pytest.fixture(scope="module")
async def server():
    srv = await MediaServer({"/a.png": samples.png(seed=1), "/b.png": samples.png(seed=2),
                             "/corrupt.png": samples.truncated(samples.png((64, 64))),
                             "/bomb.png": samples.png_claiming(100_000, 100_000),
                             "/thin.png": samples.png((1000, 1))}).start()
    yield srv
    await srv.stop()


@pytest.fixture
async def world(server, tmp_path):
    (tmp_path / "c.png").write_bytes(samples.png(seed=3))
    settings = Settings(media_allow_hosts=(f"127.0.0.1:{server.port}",), media_file_root=str(tmp_path),
                        max_image_bytes=1 << 20, max_image_pixels=1_000_000, media_cache_bytes=1 << 20)
    lane = ComputeLane("test-media")
    transfers: dict = {}
    async with MediaFetcher.from_settings(settings) as fetcher:
        handler = MediaFetchHandler(settings, fetcher, Pixels, lane)
        yield {"handler": handler, "server": server, "root": tmp_path, "transfers": transfers,
               "gateway": MemoryTransfer("gateway", transfers),
               "ctx": Context(stage="media-fetch", worker_id="mf", events=ListSink(),
                              transfer=MemoryTransfer("media-fetch", transfers))}
    lane.close()


def _request(rid: str, urls: list[str], kind: str = "image") -> protocol.MediaFetchRequest:
    now = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now, deadline_unix_ms=now + 60_000,
                                prompt_token_ids=(1, 2))
    items = tuple(protocol.MediaSource(kind=kind, param=f"messages[0].content[{i}]", url=u) for i, u in enumerate(urls))
    return protocol.MediaFetchRequest(meta=meta, items=items)


async def _fail(w, msg) -> protocol.ErrorEvent:
    with pytest.raises(RequestFailed) as info:
        await w["handler"].handle(msg, w["ctx"])
    assert w["ctx"].transfer.slots == {}  # nothing left pinned
    return info.value.event


async def test_http_and_file_sources(world):
    w, base = world, world["server"].base
    out = await w["handler"].handle(_request("r", [base + "/a.png", f"file://{w['root']}/c.png"]), w["ctx"])
    (produce,) = out.produce
    assert len(produce.value.items) == 2
    assert produce.value.items[0].mm_hash != produce.value.items[1].mm_hash


async def test_concurrent_requests_for_one_url_download_once_then_hit_the_cache(world):
    w, srv = world, world["server"]
    before = srv.hits("/b.png")
    msgs = [_request(f"c{i}", [srv.base + "/b.png"]) for i in range(6)]
    outs = await asyncio.gather(*(w["handler"].handle(m, w["ctx"]) for m in msgs))
    hashes = {o.produce[0].value.items[0].mm_hash for o in outs}
    assert len(hashes) == 1
    assert srv.hits("/b.png") - before == 1
    await w["handler"].handle(_request("again", [srv.base + "/b.png"]), w["ctx"])
    assert srv.hits("/b.png") - before == 1  # served from the LRU
    assert w["handler"].cache.bytes == len(samples.png(seed=2))


@pytest.mark.parametrize("path, status, fragment", [
    ("/corrupt.png", 400, "corrupt or truncated"),
    ("/bomb.png", 413, "pixels"),
    ("/missing.png", 400, "HTTP 404"),
])
async def test_bad_remote_media(world, path, status, fragment):
    w = world
    ev = await _fail(w, _request("bad", [w["server"].base + "/a.png", w["server"].base + path]))
    assert ev.status == status and fragment in ev.message, ev.message
    assert ev.param == "messages[0].content[1]" and ev.message.startswith("messages[0].content[1]: ")


async def test_image_the_model_processor_refuses_is_a_400(world, model_dir):
    """Qwen2-VL's processor raises ValueError for an aspect ratio above 200: a bad input (400),
    not a worker fault that would be retried and dead-lettered as a 500."""
    from shared.engines.qwen2_vl import ImagePreprocessor

    w = world
    w["handler"]._preprocess = ImagePreprocessor(model_dir)
    ev = await _fail(w, _request("thin", [w["server"].base + "/thin.png"]))
    assert ev.status == 400 and "cannot be processed by this model" in ev.message
    assert "aspect ratio" in ev.message


@pytest.mark.parametrize("url, fragment", [
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://localhost:{port}/a.png", "resolves to 127.0.0.1, a loopback address"),
    ("http://127.0.0.1:{other}/a.png", "loopback"),
    ("file:///etc/passwd", "outside the directory"),
    ("file://{root}/../etc/passwd", "'..' segments"),
    ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
])
async def test_refused_sources(world, url, fragment):
    w = world
    url = url.format(port=w["server"].port, other=w["server"].port + 1, root=w["root"])
    ev = await _fail(w, _request("ssrf", [url]))
    assert ev.status == 400 and fragment in ev.message, ev.message
    assert ev.param == "messages[0].content[0]"


async def test_unknown_kind_is_400(world):
    ev = await _fail(world, _request("k", [world["server"].base + "/a.png"], kind="video"))
    assert ev.status == 400 and "video media is not supported" in ev.message


async def test_inline_media_over_the_cap_is_refused_before_reading_it(world):
    w = world
    gw = w["gateway"]
    big = gw.put(torch.zeros(2 << 20, dtype=torch.uint8))
    now = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id="i", model="m", created_unix_ms=now, deadline_unix_ms=now + 60_000,
                                prompt_token_ids=(1,))
    msg = protocol.MediaFetchRequest(meta=meta, owner=gw.ref(), items=(
        protocol.MediaSource(kind="image", param="messages[0].content[0]", inline=big, mime="image/png"),))
    ev = await _fail(w, msg)
    assert ev.status == 413
    assert big.lease in gw.slots  # the gateway owns its inline bytes until the request ends


async def test_video_items(world, model_dir):
    """Video: decoded and sampled on the lane, preprocessed by the model's video processor, its
    mm_hash covering the sampling; a bad video is a 4xx naming the item."""
    from shared.engines.qwen2_vl import VideoPreprocessor

    w = world
    settings = Settings(media_file_root=str(w["root"]), max_video_bytes=1 << 20, max_video_duration_s=5.0,
                        video_num_frames=4)
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, w["handler"]._preprocess, w["handler"]._lane,
                                preprocess_video=VideoPreprocessor(model_dir))
    (w["root"] / "v.mp4").write_bytes(samples.video(samples.video_frames(12), fps=6))
    (w["root"] / "long.mp4").write_bytes(samples.video(samples.video_frames(70), fps=10))
    (w["root"] / "cut.mp4").write_bytes(samples.video(samples.video_frames(12), fps=6)[:500])
    url = f"file://{w['root']}/v.mp4"

    def req(rid, **sampling):
        msg = _request(rid, [url], kind="video")
        items = tuple(protocol.MediaSource(kind="video", param=it.param, url=it.url, **sampling) for it in msg.items)
        return protocol.MediaFetchRequest(meta=msg.meta, items=items)

    default = (await handler.handle(req("v1"), w["ctx"])).produce[0].value.items[0]
    assert default.kind == "video" and default.grid_thw[0] == 2  # 4 frames -> 2 temporal patches
    assert default.pixels.shape[0] == default.grid_thw[0] * default.grid_thw[1] * default.grid_thw[2]
    same = (await handler.handle(req("v2", num_frames=4), w["ctx"])).produce[0].value.items[0]
    more = (await handler.handle(req("v3", num_frames=8), w["ctx"])).produce[0].value.items[0]
    by_fps = (await handler.handle(req("v4", fps=1.0), w["ctx"])).produce[0].value.items[0]
    assert default.mm_hash == same.mm_hash  # the default is 4 frames: the same model input
    assert more.grid_thw[0] == 4 and by_fps.grid_thw[0] == 1 and len({default.mm_hash, more.mm_hash,
                                                                        by_fps.mm_hash}) == 3
    for name, status, fragment in (("long.mp4", 413, "7.0 s long, above the limit of 5 s"),
                                   ("cut.mp4", 400, "video")):
        msg = req("bad")
        items = (protocol.MediaSource(kind="video", param="messages[0].content[0]",
                                      url=f"file://{w['root']}/{name}"),)
        with pytest.raises(RequestFailed) as info:
            await handler.handle(protocol.MediaFetchRequest(meta=msg.meta, items=items), w["ctx"])
        ev = info.value.event
        assert ev.status == status and fragment in ev.message and ev.param == "messages[0].content[0]", ev


class Features:
    """A stand-in feature extractor: what media-fetch needs from one (rate in, features out)."""

    sampling_rate = 16_000

    def __call__(self, samples):
        self.last = samples
        return type("F", (), {"pixel_values": torch.zeros((8, 4), dtype=torch.float32), "grid_thw": (0, 0, 0),
                              "n_tokens": 3, "meta": (len(samples),)})()


async def test_audio_items(world):
    w = world
    settings = Settings(media_file_root=str(w["root"]), max_audio_duration_s=2.0)
    feats = Features()
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, w["handler"]._preprocess, w["handler"]._lane,
                                preprocess_audio=feats)
    (w["root"] / "a.wav").write_bytes(samples.wav(0.5, rate=44_100))
    (w["root"] / "long.wav").write_bytes(samples.wav(3.0, rate=8_000))
    (w["root"] / "silent.wav").write_bytes(samples.wav(0.5, freq=0.0))
    out = await handler.handle(_request("a", [f"file://{w['root']}/a.wav"], kind="audio"), w["ctx"])
    (item,) = out.produce[0].value.items
    assert item.kind == "audio" and item.meta == (8_000,) and feats.last.dtype.name == "float32"  # 0.5 s at 16 kHz
    for name, status, fragment in (("long.wav", 413, "3.0 s long, above the limit of 2 s"),
                                   ("silent.wav", 400, "silent")):
        handler_req = _request("bad", [f"file://{w['root']}/{name}"], kind="audio")
        with pytest.raises(RequestFailed) as info:
            await handler.handle(handler_req, w["ctx"])
        assert info.value.event.status == status and fragment in info.value.event.message


class _Index:
    """The embedding index's read side, in memory: cache key -> live entry."""

    def __init__(self) -> None:
        self.entries: dict[str, protocol.EmbeddingIndexEntry] = {}

    async def lookup_live(self, key: str) -> protocol.EmbeddingIndexEntry | None:
        return self.entries.get(key)


def _entry(owner: str, gen: int) -> protocol.EmbeddingIndexEntry:
    ref = protocol.AgentRef(name=owner, metadata=b"")
    embeds = protocol.TensorRef(agent=owner, addr=4096 * gen, nbytes=64, device_id=0, dtype="float32",
                                shape=(2, 8), lease=0)
    return protocol.EmbeddingIndexEntry(owner=ref, embeds=embeds, grid_thw=(1, 2, 2), n_tokens=2, gen=gen)


class _Counting:
    """The preprocessor, counting the images it is given."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, img) -> Pixels:
        self.calls += 1
        return Pixels(img)


async def test_index_hits_are_not_decoded_and_go_on_beside_the_misses(world):
    """A follow-up turn re-sends earlier images: those the index holds skip decode and encode;
    only the new one is decoded. All hits: straight to prefill. A restarted request: no hits."""
    w, base = world, world["server"].base
    index, pre = _Index(), _Counting()
    handler = MediaFetchHandler(Settings(media_allow_hosts=(f"127.0.0.1:{base.rsplit(':', 1)[1]}",),
                                         max_image_bytes=1 << 20, max_image_pixels=1_000_000),
                                w["handler"]._fetcher, pre, w["handler"]._lane, index=index, fingerprint="fp")
    urls = [base + "/a.png", base + "/b.png", base + "/a.png"]
    first = (await handler.handle(_request("r1", urls), w["ctx"])).produce[0]
    assert first.topic == TOPIC_ENCODE and pre.calls == 3 and first.value.cached == ()
    key_a, key_b = first.value.items[0].cache_key, first.value.items[1].cache_key
    index.entries[key_a] = _entry("enc-1", gen=7)

    pre.calls = 0
    out = (await handler.handle(_request("r2", urls), w["ctx"])).produce[0]
    assert out.topic == TOPIC_ENCODE and out.key == key_b  # routed by the item it encodes
    assert pre.calls == 1 and [it.index for it in out.value.items] == [1]
    assert [(it.index, it.cache_key, it.cache_gen, it.embeds.lease) for it in out.value.cached] == \
        [(0, key_a, 7, 0), (2, key_a, 7, 0)]
    assert [o.name for o in out.value.cached_owners] == ["enc-1"]

    index.entries[key_b] = _entry("enc-2", gen=9)
    pre.calls = 0
    out = (await handler.handle(_request("r3", urls), w["ctx"])).produce[0]
    assert out.topic == TOPIC_PREFILL and pre.calls == 0
    assert [(it.index, it.cache_gen) for it in out.value.items] == [(0, 7), (1, 9), (2, 7)]
    assert sorted(o.name for o in out.value.owners) == ["enc-1", "enc-2"]

    retry = _request("r4", urls)
    retry = protocol.MediaFetchRequest(meta=msgspec.structs.replace(retry.meta, attempt=1), items=retry.items)
    out = (await handler.handle(retry, w["ctx"])).produce[0]
    assert out.topic == TOPIC_ENCODE and pre.calls == 3 and out.value.cached == ()


class _LeasingIndex(_Index):
    """As _Index, with the encode lease (``lookup_or_lease``: one holder per key)."""

    def __init__(self) -> None:
        super().__init__()
        self.leases: dict[str, str] = {}
        self.released: list[str] = []

    async def lookup_live(self, key: str) -> protocol.EmbeddingIndexEntry | None:
        raise AssertionError("with encode in the worker the lookup takes the lease in the same round trip")

    async def lookup_or_lease(self, key: str, holder: str) -> tuple[protocol.EmbeddingIndexEntry | None, bool]:
        if key in self.entries:
            return self.entries[key], False
        if key in self.leases:
            return None, False
        self.leases[key] = holder
        return None, True

    async def release_lease(self, key: str, holder: str) -> None:
        if self.leases.get(key) == holder:
            del self.leases[key]
            self.released.append(key)


class _FailingSecond(_Counting):
    def __call__(self, img) -> Pixels:
        if self.calls == 1:
            self.calls += 1
            raise ValueError("refused")
        return super().__call__(img)


async def test_with_encode_here_the_lookup_takes_each_misses_encode_lease(world):
    """The index round trip also takes the encode lease of each item it misses (one holder per
    key: a repeat of an item in the request gets none), handed to encode on the item; a request
    that fails before its hand-over frees the leases it took."""
    w, base = world, world["server"].base
    settings = Settings(media_allow_hosts=(f"127.0.0.1:{base.rsplit(':', 1)[1]}",), max_image_bytes=1 << 20,
                        max_image_pixels=1_000_000)
    index = _LeasingIndex()
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, _Counting(), w["handler"]._lane, index=index,
                                fingerprint="fp", encode_here=True)
    out = (await handler.handle(_request("r1", [base + "/a.png", base + "/b.png", base + "/a.png"]),
                                w["ctx"])).produce[0]
    a, b, a_again = out.value.items
    assert a.lease_holder.startswith("mf#") and b.lease_holder.startswith("mf#") and a_again.lease_holder == ""
    assert index.leases == {a.cache_key: a.lease_holder, b.cache_key: b.lease_holder}

    index.leases.clear()
    failing = MediaFetchHandler(settings, w["handler"]._fetcher, _FailingSecond(), w["handler"]._lane, index=index,
                                fingerprint="fp", encode_here=True)
    with pytest.raises(RequestFailed):
        await failing.handle(_request("r2", [base + "/a.png", base + "/b.png"]), w["ctx"])
    assert index.leases == {} and sorted(index.released) == sorted([a.cache_key, b.cache_key])


def _with(msg: protocol.MediaFetchRequest, **fields) -> protocol.MediaFetchRequest:
    items = tuple(msgspec.structs.replace(it, **fields) for it in msg.items)
    return protocol.MediaFetchRequest(meta=msg.meta, items=items)


async def test_a_record_naming_pixels_beyond_the_token_bound_is_a_400_before_any_fetch(world, model_dir):
    """A record produced straight onto mm.media-fetch, past the gateway's check: a min_pixels above
    ``max_image_tokens`` of 28x28 pixels would scale even a 1x1 image up to it. Refused by name,
    terminal, nothing fetched; at the bound it is served (the processor rounds each side up to
    whole tokens: a row and a column of tokens above it at most)."""
    from shared.engines.qwen2_vl import ImagePreprocessor

    w, srv = world, world["server"]
    settings = Settings(media_allow_hosts=(f"127.0.0.1:{srv.port}",), max_image_bytes=1 << 20,
                        max_image_pixels=1_000_000, max_image_tokens=64)
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, ImagePreprocessor(model_dir), w["handler"]._lane)
    before = srv.hits("/a.png")
    for name in ("min_pixels", "max_pixels"):
        with pytest.raises(RequestFailed) as info:
            await handler.handle(_with(_request("px", [srv.base + "/a.png"]), **{name: 64 * 28 * 28 + 1}), w["ctx"])
        ev = info.value.event
        assert (ev.status, ev.param) == (400, f"mm_processor_kwargs.{name}") and "64 image tokens" in ev.message
    assert srv.hits("/a.png") == before
    out = await handler.handle(_with(_request("ok", [srv.base + "/a.png"]), min_pixels=64 * 28 * 28), w["ctx"])
    assert out.produce[0].value.items[0].n_tokens <= 64 + 8 + 9 + 1  # 48x40 scaled up: 7.3 x 8.8 tokens


async def test_a_tensor_larger_than_the_whole_pool_is_a_413_not_a_fault_to_retry(world):
    """It could never be placed: retried it would fail max_attempts times and end as a 500."""
    w = world
    settings = Settings(media_allow_hosts=(f"127.0.0.1:{w['server'].port}",), max_image_bytes=1 << 20,
                        max_image_pixels=1_000_000, pool_bytes=64)  # Pixels' tensor: 128 bytes
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, Pixels, w["handler"]._lane)
    with pytest.raises(RequestFailed) as info:
        await handler.handle(_request("big", [w["server"].base + "/a.png"]), w["ctx"])
    ev = info.value.event
    assert (ev.status, ev.code, ev.param) == (413, "media_too_large", "messages[0].content[0]")
    assert "above the 64 byte tensor pool" in ev.message and w["ctx"].transfer.slots == {}


async def test_video_frames_reach_the_processor_within_max_video_pixels(world):
    w = world
    seen = []

    def frames_in(frames, fps: float = 0.0):
        seen.append(frames.shape)
        return Pixels(type("Img", (), {"size": frames.shape})())

    settings = Settings(media_file_root=str(w["root"]), video_num_frames=4, max_video_pixels=4 * 32 * 24)
    handler = MediaFetchHandler(settings, w["handler"]._fetcher, Pixels, w["handler"]._lane,
                                preprocess_video=frames_in)
    (w["root"] / "v.mp4").write_bytes(samples.video(samples.video_frames(12), fps=6))  # 64x48
    await handler.handle(_request("v", [f"file://{w['root']}/v.mp4"], kind="video"), w["ctx"])
    assert seen == [(4, 24, 32, 3)]
