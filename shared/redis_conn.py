"""The one way a process opens Redis: URL plus ACL user/password and TLS from settings.

Credentials come from ``redis_username`` / ``redis_password`` (or the URL's userinfo), TLS from
a ``rediss://`` URL plus the ``redis_ssl_*`` files; nothing here logs a secret.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.settings import Settings


def redis_kwargs(settings: Settings) -> dict:
    """Keyword arguments for ``redis.asyncio.from_url(settings.redis_url, **kw)``."""
    kw: dict = {}
    if settings.redis_username:
        kw["username"] = settings.redis_username
    if settings.redis_password:
        kw["password"] = settings.redis_password
    if settings.redis_url.startswith("rediss://"):
        for name, arg in (("redis_ssl_cafile", "ssl_ca_certs"), ("redis_ssl_certfile", "ssl_certfile"),
                          ("redis_ssl_keyfile", "ssl_keyfile")):
            if getattr(settings, name):
                kw[arg] = getattr(settings, name)
    elif settings.redis_ssl_cafile or settings.redis_ssl_certfile or settings.redis_ssl_keyfile:
        raise ValueError("MMFLEET_REDIS_SSL_* files need a rediss:// MMFLEET_REDIS_URL")
    return kw


# Connections per process: requests in flight each issue their own commands (admission, claims,
# the router, doorbell rings: at most 64 in flight), bounded by max_inflight_requests; the
# gateway's token streams share one blocking read (shared.stream_mux). redis-py's own default
# is 100 and raises past it (40 concurrent streams, each with its own XREAD then, reached it). A
# burst past the bound waits for a free connection instead of failing the request.
_POOL_HEADROOM = 128
_POOL_WAIT_S = 10.0


def make_redis(settings: Settings) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.max_inflight_requests + _POOL_HEADROOM, timeout=_POOL_WAIT_S,
        **redis_kwargs(settings))
    return aioredis.Redis.from_pool(pool)
