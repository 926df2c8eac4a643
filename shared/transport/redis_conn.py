"""The one way a process opens Redis: URL plus ACL user/password and TLS from settings.

Credentials come from ``redis_username`` / ``redis_password`` (or the URL's userinfo), TLS from
a ``rediss://`` URL plus the ``redis_ssl_*`` files; nothing here logs a secret. Every reply and
connect is bounded by ``redis_timeout_ms``; :func:`unavailable` tells a stalled or unreachable
Redis (a 503 for a client, a retry for a worker: :func:`ride_out`) from a fault no retry cures.

Design: docs/guide/security.md, docs/guide/operations.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, AuthorizationError, ExternalAuthProviderError, MaxConnectionsError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


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
# burst past the bound waits for a free connection (up to redis_timeout_ms) instead of failing the request.
_POOL_HEADROOM = 128


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
    """The process's Redis client: replies, connects and the wait for a pooled connection each
    bounded by ``redis_timeout_ms`` (redis-py's own default is 5 s a reply); no retries inside
    redis-py, so a stall costs one bound per call and the caller decides what follows."""
    timeout_s = settings.redis_timeout_ms / 1000
    pool = WaitingPool.from_url(
        settings.redis_url, max_connections=settings.max_inflight_requests + _POOL_HEADROOM, timeout=timeout_s,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **redis_kwargs(settings))
    pool.connection_class = _direct_send(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


_REFUSED = (AuthenticationError, AuthorizationError, ExternalAuthProviderError)  # configuration: no retry cures it
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0  # the most a Redis that came back waits to be used again


def unavailable(exc: BaseException) -> bool:
    """Redis stalled, restarting or unreachable (a timeout, a lost or refused connection, a
    server still loading): worth a retry. A refused login or ACL is a configuration fault."""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and not isinstance(exc, _REFUSED)


async def ride_out(call: Callable[[], Awaitable[T]], *, until_unix_ms: float, what: str) -> T:
    """``await call()``, again with backoff (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``)
    while it fails with Redis :func:`unavailable`; past ``until_unix_ms`` that error is raised.
    Any other error is raised at once. ``what``: for the log."""
    delay_s = RETRY_FIRST_S
    while True:
        try:
            return await call()
        except Exception as exc:
            if not unavailable(exc) or time.time() * 1000 + delay_s * 1000 > until_unix_ms:
                raise
            log.warning("%s: Redis unavailable (%r); again in %.1f s", what, exc, delay_s)
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, RETRY_MAX_S)
