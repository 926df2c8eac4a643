"""Per-request token logs in Redis streams. A request's stream holds ``StreamEvent`` entries in
order and ends with exactly one terminal event (``Finish`` or ``ErrorEvent``) in normal operation.
Streams are bounded (``MAXLEN ~``) and expire ``ttl_s`` after the last write, so an abandoned
request cannot grow Redis without bound. Readers resume from the last entry id they saw; a
process's followers share one blocking read. Compare-and-appends made in one event-loop turn go
to Redis in one script call; a guarded append (``append_delta_if``, ``shared.transport.ledger.WriteGuard``)
is written only if Redis shows its guard met, in the same call.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis

from shared import protocol
from shared.keys import RedisKeys
from shared.stage import LogLost
from shared.transport.ledger import WriteGuard
from shared.transport.redis_lean import as_dict, lean_of
from shared.transport.stream_mux import StreamMux

_FIELD = b"e"
# how long a follower waits without news before it checks that its log still exists
LOST_CHECK_S = 2.0
log = logging.getLogger(__name__)

# KEYS: (stream, position counter, claim, acked) per append; ARGV: maxlen, ttl_s, then (position,
# encoded delta, owner, partition) per append: an append with an owner is guarded (WriteGuard: the
# claim must hold the owner, the acked key the partition; unguarded ones pass the counter as both).
# Per append, in order: 1 appended; 0 another writer has that position; 2 the log is gone
# (flushed) past position 0; 3 the guard is not met (nothing written). One call for a whole
# decode step: a call costs more than its work.
_APPEND_AT_SEQ = """
local out = {}
for i = 1, #KEYS, 4 do
  local pos = tonumber(ARGV[i + 2])
  local owner = ARGV[i + 4]
  local nxt = redis.call('get', KEYS[i + 1])
  if owner ~= '' and (redis.call('get', KEYS[i + 2]) ~= owner or redis.call('get', KEYS[i + 3]) ~= ARGV[i + 5]) then
    out[#out + 1] = 3
  elseif nxt and tonumber(nxt) ~= pos then
    out[#out + 1] = 0
  elseif not nxt and pos > 0 then
    out[#out + 1] = 2
  else
    redis.call('xadd', KEYS[i], 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i + 3])
    redis.call('set', KEYS[i + 1], pos + 1, 'EX', ARGV[2])
    redis.call('expire', KEYS[i], ARGV[2])
    out[#out + 1] = 1
  end
end
return out
"""
_UNGUARDED = ""  # an append's owner when it has no WriteGuard


class TokenStreams:
    """Append / read request streams. One instance per process, shared by all handlers."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, *, maxlen: int, ttl_s: int,
                 read_block_ms: int = 1000) -> None:
        self._redis = redis
        self._keys = keys
        self._maxlen = maxlen
        self._ttl_s = ttl_s
        self._cas = redis.register_script(_APPEND_AT_SEQ)
        self._appends = lean_of(redis)  # ~1 script call a decode step: the lean client's (shared.transport.redis_lean)
        # appends waiting for the next script call: at most one per writer, each awaits its own;
        # keys (stream, counter, claim, acked) and args (position, delta, owner, partition)
        self._batch: list[tuple[tuple[str, str, str, str], tuple[int, bytes, str, int], asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._mux = StreamMux(redis, keys.stream_wake(uuid.uuid4().hex), ttl_s=ttl_s, block_ms=read_block_ms)

    async def append(self, request_id: str, event: protocol.StreamEvent) -> None:
        """Write one event (XADD + refresh TTL in one round trip)."""
        key = self._keys.token_stream(request_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {_FIELD: protocol.encode(event)}, maxlen=self._maxlen, approximate=True)
            pipe.expire(key, self._ttl_s)
            await pipe.execute()

    async def append_delta(self, request_id: str, delta: protocol.StreamEvent, position: int) -> bool:
        """Compare-and-append (one round trip): XADD ``delta`` only if ``position`` is the
        request's next delta position (``RedisKeys.token_seq``). False: another decode of the
        request wrote that position first. A missing counter (Redis flushed, or the log expired)
        accepts position 0 only; past it, :class:`~shared.stage.LogLost`. Appends of one loop
        turn share one script call (:meth:`_flush`)."""
        return bool(await self._append(request_id, delta, position, None))

    async def append_delta_if(self, request_id: str, delta: protocol.StreamEvent, position: int,
                              guard: WriteGuard) -> bool | None:
        """:meth:`append_delta` if Redis shows ``guard`` met (checked in the same script call);
        None: it is not, and nothing was written."""
        res = await self._append(request_id, delta, position, guard)
        return None if res == 3 else bool(res)

    def append_delta_soon(self, request_id: str, delta: protocol.StreamEvent, position: int) -> asyncio.Future:
        """:meth:`append_delta` queued for this loop turn's script call, not awaited: the writer
        goes on meanwhile (a decode's next token) and reads the outcome later. The future's
        result: 1 appended, 0 another writer has the position, 2 the log is gone past position
        0. A writer keeps one in flight per log: two could reach Redis out of order (the calls
        share no connection)."""
        return self._queue(request_id, delta, position, None)

    def _queue(self, request_id: str, delta: protocol.StreamEvent, position: int,
               guard: WriteGuard | None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        stream, seq = self._keys.token_stream(request_id), self._keys.token_seq(request_id)
        claim, owner, acked, partition = guard if guard is not None else (seq, _UNGUARDED, seq, 0)
        self._batch.append(((stream, seq, claim, acked), (position, protocol.encode(delta), owner, partition), fut))
        if self._flusher is None:  # runs after the writers already woken this turn have queued theirs
            self._flusher = asyncio.create_task(self._flush(), name="token-appends")
        return fut

    async def _append(self, request_id: str, delta: protocol.StreamEvent, position: int,
                      guard: WriteGuard | None) -> int:
        res = await self._queue(request_id, delta, position, guard)
        if res == 2:
            raise LogLost(f"the token log of {request_id} is gone (Redis flushed?) at position {position}")
        return res

    async def _flush(self) -> None:
        batch, self._batch, self._flusher = self._batch, [], None
        keys = [k for ks, _, _ in batch for k in ks]
        args = [self._maxlen, self._ttl_s, *(v for _, each, _ in batch for v in each)]
        try:  # EVALSHA; a Redis that restarted or flushed its scripts gets the script loaded again
            results = await self._appends.evalsha(self._cas, keys, args)
        except BaseException as exc:  # noqa: BLE001 - every writer of the batch sees the failure
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    async def follow(self, request_id: str, *, deadline_s: float,
                     on_lost: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[protocol.StreamEvent]:
        """Yield events until a terminal one; raises ``TimeoutError`` past ``deadline_s``
        (a ``loop.time()`` value), or the reader's Redis error. Every follow of this instance
        shares one blocking read (:class:`~shared.transport.stream_mux.StreamMux`). Each delta position is
        yielded once: a log rewritten from the start (Redis flushed between prefill's first token
        and decode's read of the log) repeats positions the reader already has, and those are
        dropped.

        A log that vanishes after this reader saw part of it (Redis flushed once its writer had
        finished, so nobody writes it again) is noticed after ``LOST_CHECK_S`` without news: the
        deltas read so far are written back (compare-and-append, so a writer that is still
        running keeps its own) and ``on_lost`` asks for the request to run again; its decode
        resumes after those deltas (shared/engines/token_stream.py)."""
        loop = asyncio.get_running_loop()
        key = self._keys.token_stream(request_id)
        sub = await self._mux.subscribe(key)
        next_seq = 0
        seen: list[protocol.TokenDelta] = []  # in order: what a lost log is written back from
        # One timer per follower, armed for the next check (deadline, or LOST_CHECK_S after the
        # last news) and re-armed only once it has fired: a timeout around every wait cost a
        # timer's creation and cancel per token
        news_at = loop.time()
        timer: asyncio.TimerHandle | None = None
        try:
            while True:
                while not sub.entries:
                    if sub.error is not None:
                        raise sub.error
                    now = loop.time()
                    if now >= deadline_s:
                        raise TimeoutError(f"no terminal event for {request_id} before the deadline")
                    if now - news_at >= LOST_CHECK_S:
                        news_at = now  # the next check LOST_CHECK_S from now
                        if seen and not await self._redis.exists(key):
                            await self._restore(request_id, seen, on_lost)
                        continue  # the check awaited: entries may have come meanwhile
                    if timer is None or timer.when() <= now:
                        timer = loop.call_at(min(deadline_s, news_at + LOST_CHECK_S), sub.event.set)
                    sub.event.clear()  # nothing can arrive between the checks above and the wait
                    await sub.event.wait()
                news_at = loop.time()
                _eid, fields = sub.entries.popleft()
                event = protocol.decode_event(fields[_FIELD])
                if isinstance(event, protocol.TokenDelta):
                    if event.seq < next_seq:
                        continue
                    next_seq = event.seq + 1
                    seen.append(event)
                yield event
                if isinstance(event, (protocol.Finish, protocol.ErrorEvent)):
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._mux.unsubscribe(key)

    async def _restore(self, request_id: str, seen: list[protocol.TokenDelta],
                       on_lost: Callable[[], Awaitable[None]] | None) -> None:
        log.warning("request %s: its token log is gone (Redis flushed?) after %d deltas were read; writing them "
                    "back%s", request_id, len(seen), " and running the request again" if on_lost else "")
        try:
            for position, delta in enumerate(seen):
                if not await self.append_delta(request_id, delta, position=position):
                    return  # a writer is at work on it again: it rewrites the log itself
        except LogLost:
            return  # flushed again meanwhile: the next check writes it back
        if on_lost is not None:
            await on_lost()

    async def close(self) -> None:
        """Stop the shared reader (followers still open get no more events)."""
        await self._mux.close()

    async def history(self, request_id: str) -> list[protocol.StreamEvent]:
        entries = await self._appends.call("XRANGE", self._keys.token_stream(request_id), "-", "+")
        return [protocol.decode_event(as_dict(fields)[_FIELD]) for _id, fields in entries]

    async def delete(self, request_id: str) -> None:
        await self._redis.delete(self._keys.token_stream(request_id))
