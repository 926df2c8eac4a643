"""In-flight de-duplication and the byte-bounded LRU of fetched bytes."""

from __future__ import annotations

import asyncio

import pytest

from shared.media.cache import FetchCache
from shared.media.sources import MediaError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_concurrent_requests_share_one_download():
    cache = FetchCache(1 << 20)
    calls = 0
    gate = asyncio.Event()

    async def fetch():
        nonlocal calls
        calls += 1
        await gate.wait()
        return b"bytes"

    waiters = [asyncio.ensure_future(cache.get_or_fetch("u", fetch)) for _ in range(10)]
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.gather(*waiters) == [b"bytes"] * 10
    assert calls == 1 and (cache.misses, cache.joined) == (1, 9)
    assert await cache.get_or_fetch("u", fetch) == b"bytes" and calls == 1 and cache.hits == 1


async def test_errors_reach_every_waiter_and_are_not_cached():
    cache = FetchCache(1 << 20)
    calls = 0

    async def failing():
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        raise MediaError("HTTP 404")

    results = await asyncio.gather(*(cache.get_or_fetch("u", failing) for _ in range(5)), return_exceptions=True)
    assert calls == 1 and all(isinstance(r, MediaError) for r in results)
    with pytest.raises(MediaError):
        await cache.get_or_fetch("u", failing)
    assert calls == 2 and len(cache) == 0


async def test_a_cancelled_waiter_does_not_cancel_the_download():
    cache = FetchCache(1 << 20)
    gate = asyncio.Event()

    async def fetch():
        await gate.wait()
        return b"done"

    first = asyncio.ensure_future(cache.get_or_fetch("u", fetch))
    second = asyncio.ensure_future(cache.get_or_fetch("u", fetch))
    await asyncio.sleep(0.01)
    first.cancel()
    gate.set()
    assert await second == b"done"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_lru_is_bounded_in_bytes():
    cache = FetchCache(1000)
    for key in "abc":
        await cache.get_or_fetch(key, _const(b"x" * 400))
    assert cache.bytes <= 1000 and len(cache) == 2 and cache.get("a") is None  # a was evicted
    assert cache.get("b") is not None  # b is now the most recent
    await cache.get_or_fetch("d", _const(b"y" * 400))
    assert cache.get("c") is None and cache.get("b") is not None and cache.bytes == 800
    await cache.get_or_fetch("huge", _const(b"z" * 5000))  # served, not kept
    assert cache.get("huge") is None and cache.bytes == 800


async def test_zero_capacity_disables_caching_but_not_dedup():
    cache = FetchCache(0)
    assert await cache.get_or_fetch("u", _const(b"abc")) == b"abc"
    assert len(cache) == 0 and cache.bytes == 0


async def test_entries_expire():
    clock = Clock()
    cache = FetchCache(1000, ttl_s=10, clock=clock)
    await cache.get_or_fetch("u", _const(b"old"))
    clock.t = 9
    assert cache.get("u") == b"old"
    clock.t = 20
    assert cache.get("u") is None and cache.bytes == 0
    assert await cache.get_or_fetch("u", _const(b"new")) == b"new"


def _const(value: bytes):
    async def fetch():
        return value

    return fetch
