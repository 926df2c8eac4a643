"""A lean pipelined Redis connection (:class:`LeanRedis`) for a process's per-request calls
(token-log appends and reads, the shared XREAD, stage claims, the routing table, the embedding
index): hiredis packs each command and parses each reply, nothing else runs per call (redis-py
costs ~75 µs of client CPU a call against ~30 for this). Calls are pipelined on one connection
and resolve in call order; errors are redis-py's. :func:`lean_of` gives a redis-py client's one
shared ``LeanRedis``; a blocking reader opens its own.

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import collections

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["LeanRedis", "as_dict", "lean_of"]

CONNECT_TIMEOUT_S = 10.0
MAX_IN_FLIGHT = 256  # a process sends one script call per loop turn and one read per mux: far below


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout_s: float | None) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error)
        self.pending: collections.deque[asyncio.Future] = collections.deque()
        self.deadlines: collections.deque[float] = collections.deque()  # loop.time() each reply is due by
        self.lost: BaseException | None = None
        self._timeout_s = timeout_s
        self._watch: asyncio.TimerHandle | None = None  # armed at the oldest call's deadline

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, packed: bytes, futs: list[asyncio.Future], blocking_s: float | None) -> None:
        self.pending.extend(futs)
        if self._timeout_s is not None:
            loop = asyncio.get_running_loop()
            due = loop.time() + self._timeout_s + (blocking_s or 0.0)
            self.deadlines.extend([due] * len(futs))
            if self._watch is None:
                self._watch = loop.call_at(self.deadlines[0], self._check)
        self.transport.write(packed)

    def _check(self) -> None:
        """One timer a connection, not one a call: fired at the oldest call's deadline."""
        self._watch = None
        if not self.deadlines or self.lost is not None:
            return
        loop = asyncio.get_running_loop()
        if self.deadlines[0] <= loop.time():
            self.transport.close()
            self.connection_lost(RedisTimeoutError(f"no reply from Redis within {self._timeout_s} s"))
        else:
            self._watch = loop.call_at(self.deadlines[0], self._check)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending, deadlines = self.pending, self.deadlines
        try:
            while (reply := self.reader.gets()) is not False:
                fut = pending.popleft()
                if deadlines:
                    deadlines.popleft()
                if fut.done():  # its caller was cancelled
                    continue
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        except (InvalidResponse, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.transport.close()
            self.connection_lost(exc)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.lost is not None:
            return
        if isinstance(exc, RedisTimeoutError):
            self.lost = exc
        else:
            self.lost = RedisConnectionError(f"Redis connection lost: {exc!r}" if exc else "Redis connection closed")
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.deadlines.clear()
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(self.lost)


class LeanRedis:
    """Talks to the server of a redis-py client with that client's connection settings (host and
    port or unix path, TLS context, username / password, db); connects at its first call and again
    at the first call after a connection was lost.

    - ``await call(*args)``: the reply as hiredis gives it (RESP2: bytes, ints, lists; None for
      nil); an error reply raises what redis-py raises for it (``ResponseError``,
      ``NoScriptError``, ...). ``await pipeline(commands)``: their replies, in one write; the first
      error reply raises, once every reply is in.
    - At most ``max_in_flight`` calls are in flight; more wait.
    - A lost connection fails every call in flight with ``redis.exceptions.ConnectionError``. A
      reply later than the client's ``socket_timeout`` (plus ``blocking_s`` for a call that blocks
      in Redis, e.g. XREAD BLOCK) drops the connection and fails its calls with redis-py's
      ``TimeoutError``. A caller cancelled while its call blocks drops the connection, so later
      calls do not queue behind that reply; any other cancelled call's reply is read and discarded."""

    def __init__(self, client: aioredis.Redis, *, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.client = client
        pool = client.connection_pool
        # a connection object of the client's own class, never connected: its settings, as redis-py resolved them
        self._model = pool.connection_class(**pool.connection_kwargs)
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._room = asyncio.Semaphore(max_in_flight)

    async def call(self, *args, blocking_s: float | None = None):
        """One command; ``blocking_s``: it may block in Redis that long (XREAD BLOCK, BLPOP)."""
        async with self._room:
            proto = await self._ready()
            fut = asyncio.get_running_loop().create_future()
            proto.send(hiredis.pack_command(args), [fut], blocking_s)
            try:
                return await fut
            except asyncio.CancelledError:
                if blocking_s is not None and proto.lost is None:  # its reply could hold every later call back
                    proto.transport.close()
                raise

    async def pipeline(self, commands: list[tuple]) -> list:
        async with self._room:
            proto = await self._ready()
            loop = asyncio.get_running_loop()
            futs = [loop.create_future() for _ in commands]
            proto.send(b"".join([hiredis.pack_command(c) for c in commands]), futs, None)
            replies = await asyncio.gather(*futs, return_exceptions=True)
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        return replies

    async def _ready(self) -> _Protocol:
        proto = self._proto
        if proto is None or proto.lost is not None or proto.transport.is_closing():
            proto = await self._connect()
        return proto

    async def evalsha(self, script, keys: list, args: list):
        """EVALSHA of a redis-py ``Script`` (``register_script``), loading it first if the server
        lacks it (a restarted or flushed Redis)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.call("SCRIPT", "LOAD", script.script)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    def _new_protocol(self) -> _Protocol:
        return _Protocol(self._model.socket_timeout)

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    async def _connect(self) -> _Protocol:
        if self._connecting is None:  # one connect for every caller that finds no connection
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        model = self._model
        try:
            async with asyncio.timeout(model.socket_connect_timeout or CONNECT_TIMEOUT_S):
                if getattr(model, "path", None):
                    _, proto = await loop.create_unix_connection(self._new_protocol, model.path)
                else:
                    _, proto = await loop.create_connection(self._new_protocol, **model._connection_arguments())
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc!r}") from exc
        hello = []
        provider = model.credential_provider or (
            UsernamePasswordCredentialProvider(model.username, model.password)
            if model.username or model.password else None)
        if provider is not None:
            hello.append(("AUTH", *provider.get_credentials()))
        if int(model.db or 0):
            hello.append(("SELECT", int(model.db)))
        futs = [loop.create_future() for _ in hello]
        if hello:
            proto.send(b"".join([hiredis.pack_command(c) for c in hello]), futs, None)
        try:
            for fut in futs:
                await fut
        except BaseException:
            proto.transport.close()
            raise
        self._proto = proto
        return proto


def lean_of(client: aioredis.Redis) -> LeanRedis:
    """The shared lean connection of ``client`` (made at the first ask): the per-request calls of
    a process (token appends, stage claims) pipeline on it."""
    lean = getattr(client, "_mmfleet_lean", None)
    if lean is None:
        lean = client._mmfleet_lean = LeanRedis(client)
    return lean


def as_dict(flat: list) -> dict:
    """A RESP2 field/value array (HGETALL, a stream entry's fields) as redis-py's RESP3 dict."""
    return dict(zip(flat[::2], flat[1::2]))
