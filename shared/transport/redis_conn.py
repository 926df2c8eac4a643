"""The one way a process opens Redis: URL plus ACL user/password and TLS from settings.

Credentials come from ``redis_username`` / ``redis_password`` (or the URL's userinfo), TLS from
a ``rediss://`` URL plus the ``redis_ssl_*`` files; nothing here logs a secret.

Design: docs/guide/security.md.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import MaxConnectionsError

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
# gateway's token streams share one blocking read (shared.transport.stream_mux). redis-py's own default
# is 100 and raises past it (40 concurrent streams, each with its own XREAD then, reached it). A
# burst past the bound waits for a free connection instead of failing the request.
_POOL_HEADROOM = 128
_POOL_WAIT_S = 10.0


class WaitingPool(aioredis.BlockingConnectionPool):
    """A ``BlockingConnectionPool`` that takes a free connection the way ``ConnectionPool`` does
    and uses its condition and timeout only while the pool is exhausted or others wait for room.
    Its own ``get_connection`` and ``release`` cost ~60 µs more per command here (~210 against
    ~150 µs of client CPU for a lone GET) on every command a process sends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting = 0  # callers in the blocking path: a release must wake one of them

    async def get_connection(self, *args, **kwargs):  # redis-py calls it without arguments
        if not self._waiting and self.can_get_connection():
            try:
                return await aioredis.ConnectionPool.get_connection(self, *args, **kwargs)
            except MaxConnectionsError:  # the last one went while this call waited for the pool's lock
                pass
        self._waiting += 1
        try:
            return await super().get_connection(*args, **kwargs)
        finally:
            self._waiting -= 1

    async def release(self, connection) -> None:
        if self._waiting:
            await super().release(connection)  # and notify a waiter
            return
        await aioredis.ConnectionPool.release(self, connection)
        if self._waiting:  # one began to wait while this release waited for the pool's lock
            async with self._condition:
                self._condition.notify()


def write_at_once(conn, command) -> bool:
    """Write a packed ``command`` (bytes or chunks) to a connected redis-py connection's socket
    within this call, when nothing is buffered there and it is not closing; False: nothing was
    written. Bytes the socket did not take stay in the transport's buffer."""
    writer = conn._writer  # redis-py internals: tests/transport/test_redis_pool.py pins them
    if writer is None or writer.transport.is_closing() or writer.transport.get_write_buffer_size():
        return False
    writer.writelines((command,) if isinstance(command, bytes) else command)
    return True


class _DirectSend:
    """For redis-py's connection classes: a command the socket takes at once is written without
    the ``asyncio.wait_for`` redis-py puts around every send under ``socket_timeout`` (a Task and
    a timer per command: ~60 of the ~200 µs of client CPU a lone GET costs here). A send that has
    to wait for the socket (buffer full, connection closing, a health check due) goes redis-py's
    way, under that timeout; reads keep theirs."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        if (isinstance(command, str) or (check_health and self.health_check_interval)
                or not write_at_once(self, command)):
            return await super().send_packed_command(command, check_health)
        if self._writer.transport.get_write_buffer_size():  # not all taken: drain, bounded, as redis-py would
            await super().send_packed_command(b"", check_health=False)


def _direct_send(cls: type) -> type:
    return type(f"DirectSend{cls.__name__}", (_DirectSend, cls), {})


def make_redis(settings: Settings) -> aioredis.Redis:
    pool = WaitingPool.from_url(
        settings.redis_url, max_connections=settings.max_inflight_requests + _POOL_HEADROOM, timeout=_POOL_WAIT_S,
        **redis_kwargs(settings))
    pool.connection_class = _direct_send(pool.connection_class)
    return aioredis.Redis.from_pool(pool)
