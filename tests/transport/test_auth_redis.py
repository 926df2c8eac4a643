"""Against a real redis-server: an ACL password from settings (a server started with
``--requirepass``), and per-key rate limits counted in Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.gateway.auth import Authenticator, hash_key
from services.gateway.responses import Rejected
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.transport.redis_conn import make_redis
from tests import procs

PASSWORD = "redis-acl-Pa55-7781"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    with procs.redis_server(tmp_path_factory.mktemp("locked-redis"), password=PASSWORD) as url:
        yield url


def test_password_from_settings_opens_a_locked_redis(locked_redis):
    async def go():
        good = make_redis(settings_mod.from_env({}, redis_url=locked_redis, redis_password=PASSWORD))
        bad = make_redis(settings_mod.from_env({}, redis_url=locked_redis, redis_password="wrong"))
        none = make_redis(settings_mod.from_env({}, redis_url=locked_redis))
        try:
            assert await good.ping()
            with pytest.raises(redis.exceptions.AuthenticationError) as info:
                await bad.ping()
            assert PASSWORD not in str(info.value) and "wrong" not in str(info.value)
            with pytest.raises(redis.exceptions.AuthenticationError):
                await none.ping()
        finally:
            for c in (good, bad, none):
                await c.aclose()

    asyncio.run(go())


def test_rate_limit_per_key_is_a_429_with_retry_after(redis_url):
    key_a, key_b = "sk-limited-aaa", "sk-free-bbb"
    s = settings_mod.from_env({}, api_key_hashes=(hash_key(key_a) + ":3", hash_key(key_b)))

    async def go():
        r = aioredis.from_url(redis_url)
        prefix = f"rl{procs.free_port()}"
        auth = Authenticator(s, r, RedisKeys(prefix))
        try:
            ida, idb = auth.identify(f"Bearer {key_a}", via="http"), auth.identify(f"Bearer {key_b}", via="http")
            for _ in range(3):
                await auth.charge(ida, via="http")
            with pytest.raises(Rejected) as info:
                await auth.charge(ida, via="http")
            assert info.value.event.status == 429 and info.value.event.code == "rate_limit_exceeded"
            assert 1 <= info.value.retry_after_s <= 61
            assert key_a not in info.value.event.message
            for _ in range(10):  # a key without a limit is never refused
                await auth.charge(idb, via="http")
            # a second gateway (another Authenticator over the same Redis) sees the same count
            other = Authenticator(s, r, RedisKeys(prefix))
            with pytest.raises(Rejected):
                await other.charge(ida, via="kafka")
        finally:
            await r.aclose()

    asyncio.run(go())
