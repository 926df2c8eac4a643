"""media-fetch's handler with client-named items (``MediaSource.uuid``) and cache scopes, with
in-memory ports: a named item is keyed by its name in its scope (the key the gateway resolves),
looked up before its bytes are fetched, served from the index alone when the request carries no
data, and a 400 naming it when the index no longer holds it; the same bytes in two scopes never
share a key."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.gateway.media_names import item_key
from services.media_fetch.handler import MediaFetchHandler
from shared import protocol
from shared.keys import TOPIC_ENCODE, TOPIC_PREFILL
from shared.settings import Settings
from shared.stage import RequestFailed
from tests.media import test_handler
from tests.media.test_handler import _Counting, _entry, _Index

server, world = test_handler.server, test_handler.world  # its fixtures, used here as they are


def _request(rid: str, sources: list[protocol.MediaSource], scope: str = "") -> protocol.MediaFetchRequest:
    now = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now, deadline_unix_ms=now + 60_000,
                                prompt_token_ids=(1, 2), cache_scope=scope)
    return protocol.MediaFetchRequest(meta=meta, items=tuple(sources))


@pytest.fixture
def named(world):
    base = world["server"].base
    index, pre = _Index(), _Counting()
    handler = MediaFetchHandler(Settings(media_allow_hosts=(f"127.0.0.1:{base.rsplit(':', 1)[1]}",),
                                         max_image_bytes=1 << 20, max_image_pixels=1_000_000, media_cache_bytes=0),
                                world["handler"]._fetcher, pre, world["handler"]._lane, index=index, fingerprint="fp")
    return world, handler, index, pre


def src(uuid: str, url: str = "", kind: str = "image", i: int = 0) -> protocol.MediaSource:
    return protocol.MediaSource(kind=kind, param=f"messages[0].content[{i}]", url=url, uuid=uuid)


async def test_a_named_item_is_fetched_once_then_served_by_name_without_its_bytes(named):
    w, handler, index, pre = named
    media, url = w["server"], w["server"].base + "/a.png"
    fetched = media.hits("/a.png")
    first = (await handler.handle(_request("r1", [src("cat-1", url)], "scope-a"), w["ctx"])).produce[0]
    assert first.topic == TOPIC_ENCODE and media.hits("/a.png") == fetched + 1 and pre.calls == 1
    (item,) = first.value.items
    # the key the gateway resolves a data-less part by
    assert item.cache_key == item_key("fp", "image", "cat-1", "scope-a", min_pixels=0, max_pixels=0, num_frames=0,
                                      fps=0.0)
    index.entries[item.cache_key] = _entry("enc-1", gen=5)

    for sources in ([src("cat-1", url)], [src("cat-1")]):  # the same part again, then the name alone
        out = (await handler.handle(_request("r2", sources, "scope-a"), w["ctx"])).produce[0]
        assert out.topic == TOPIC_PREFILL and pre.calls == 1 and media.hits("/a.png") == fetched + 1
        assert [(it.cache_key, it.cache_gen, it.mm_hash) for it in out.value.items] == \
            [(item.cache_key, 5, item.mm_hash)]


async def test_a_name_another_scope_cached_is_unknown_here(named):
    w, handler, index, _ = named
    key = item_key("fp", "image", "cat-1", "scope-a", min_pixels=0, max_pixels=0, num_frames=0, fps=0.0)
    index.entries[key] = _entry("enc-1", gen=5)
    with pytest.raises(RequestFailed) as info:
        await handler.handle(_request("r", [src("cat-1", i=1)], "scope-b"), w["ctx"])
    ev = info.value.event
    assert (ev.status, ev.param, ev.code) == (400, "messages[0].content[1]", "unknown_media_uuid")
    assert w["ctx"].transfer.slots == {}


async def test_an_entry_gone_since_admission_is_a_400_even_on_a_restart(named):
    w, handler, index, _ = named
    msg = _request("r", [src("cat-1")])
    retry = protocol.MediaFetchRequest(meta=msgspec.structs.replace(msg.meta, attempt=1), items=msg.items)
    for m in (msg, retry):
        with pytest.raises(RequestFailed) as info:
            await handler.handle(m, w["ctx"])
        assert (info.value.event.status, info.value.event.code) == (400, "unknown_media_uuid")
    key = item_key("fp", "image", "cat-1", "", min_pixels=0, max_pixels=0, num_frames=0, fps=0.0)
    index.entries[key] = _entry("enc-1", gen=3)  # re-encoded meanwhile: a restart takes it by name
    out = (await handler.handle(retry, w["ctx"])).produce[0]
    assert out.topic == TOPIC_PREFILL and out.value.items[0].cache_gen == 3


async def test_a_named_audio_clip_takes_its_whole_geometry_from_the_entry(named):
    w, handler, index, _ = named
    key = item_key("fp", "audio", "clip", "", min_pixels=0, max_pixels=0, num_frames=0, fps=0.0)
    index.entries[key] = msgspec.structs.replace(_entry("enc-1", gen=4), meta=(37, 9), second_per_grid_t=0.5)
    out = (await handler.handle(_request("r", [src("clip", kind="audio")]), w["ctx"])).produce[0]
    (item,) = out.value.items
    assert (item.kind, item.meta, item.second_per_grid_t, item.n_tokens) == ("audio", (37, 9), 0.5, 2)


async def test_the_same_bytes_in_two_scopes_never_share_a_hash(named):
    w, handler, _, _ = named
    url = w["server"].base + "/b.png"
    hashes = {}
    for scope in ("", "scope-a", "scope-b", "scope-a"):
        out = (await handler.handle(_request("r", [protocol.MediaSource(kind="image", param="p", url=url)], scope),
                                    w["ctx"])).produce[0]
        (item,) = out.value.items
        hashes.setdefault(scope, set()).add((item.mm_hash, item.cache_key))
        w["ctx"].transfer.free_local(item.pixels.lease)
    assert all(len(v) == 1 for v in hashes.values())  # stable within a scope
    assert len({k for v in hashes.values() for k in v}) == 3
