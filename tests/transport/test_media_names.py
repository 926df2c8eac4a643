"""Client-named items against real Redis and real NIXL agents: what an encode worker caches under
a name is what the gateway's resolver finds in that scope (geometry included), nowhere else;
an owner gone makes the name unknown; a Redis that cannot answer is a 503, not "unknown"."""

from __future__ import annotations

import msgspec
import pytest
import redis.asyncio as aioredis

from services.gateway.media_names import MediaNames, item_key
from services.gateway.prompt import MediaInput
from services.gateway.responses import Rejected
from shared.embcache.index import EmbeddingIndex
from tests.transport import test_embedding_cache
from tests.transport.test_embedding_cache import EMB, CountingEncoder, make_cache, pixel_item

env = test_embedding_cache.env  # its fixture: one Redis namespace and three agents per test


async def _refusal(names: MediaNames, item: MediaInput, scope: str):
    with pytest.raises(Rejected) as info:
        await names.check([item], scope)
    return info.value.event


async def test_a_name_cached_by_encode_resolves_in_its_scope_with_its_geometry(env) -> None:
    redis, keys, index, (enc0, _, _) = env
    cache, _ = make_cache(index, enc0)
    key = item_key("fp", "audio", "clip-1", "scope-a", min_pixels=0, max_pixels=0, num_frames=0, fps=0.0)
    item = msgspec.structs.replace(pixel_item(key), kind="audio", meta=(37, 9), second_per_grid_t=0.5)
    await cache.embed(item, CountingEncoder(enc0, delay_s=0)(1), fleet_ok=True, deadline_unix_ms=2**62)
    await cache.drain()

    entry = await index.resolve(key)
    assert entry is not None and entry.owner.name == enc0.name
    assert (entry.n_tokens, entry.meta, entry.second_per_grid_t) == (EMB[0], (37, 9), 0.5)
    names = MediaNames(index, "fp")
    clip = MediaInput("audio", "messages[0].content[0]", uuid="clip-1")
    await names.check([clip], "scope-a")
    ev = await _refusal(names, clip, "scope-b")
    assert (ev.status, ev.param, ev.code) == (400, "messages[0].content[0]", "unknown_media_uuid")

    await redis.delete(keys.alive(enc0.name))  # its owner is gone: the name is unknown again
    assert await index.resolve(key) is None
    assert (await _refusal(names, clip, "scope-a")).code == "unknown_media_uuid"


async def test_redis_away_is_a_503_not_an_unknown_name(env) -> None:
    _, keys, _, _ = env
    away = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)  # nothing listens there
    try:
        names = MediaNames(EmbeddingIndex(away, keys, ttl_s=60, lease_ms=400), "fp")
        ev = await _refusal(names, MediaInput("image", "messages[0].content[0]", uuid="cat"), "")
        assert ev.status == 503
    finally:
        await away.aclose()
