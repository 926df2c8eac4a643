"""The Redis side of the embedding cache (:class:`EmbeddingIndex`): the index of which encode
worker holds which embedding, and the ``SET NX PX`` lease that coalesces concurrent encodes of
one key across workers. Advisory: every read swallows Redis errors and answers "no entry", so a
Redis outage or FLUSHALL costs misses, never errors; an entry whose owner is gone is not used.

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import protocol
from shared.keys import RedisKeys
from shared.transport.redis_lean import lean_of

log = logging.getLogger(__name__)

_DEL_IF_GEN = "if redis.call('hget', KEYS[1], 'gen') == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_DEL_IF_OWNER = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# after an encode, in one round trip and in this order: the entry, the lease release (waiters
# poll for the entry until the lease goes), the fleet counter; '' / '0' skip a step
_FINISH_ENCODE = """
if ARGV[1] ~= '' then
  redis.call('hset', KEYS[1], 'v', ARGV[1], 'gen', ARGV[2])
  redis.call('expire', KEYS[1], ARGV[3])
end
if ARGV[4] ~= '' and redis.call('get', KEYS[2]) == ARGV[4] then redis.call('del', KEYS[2]) end
if ARGV[5] ~= '0' then redis.call('incrby', KEYS[3], ARGV[5]) end
return 0
"""
_ERRORS = (RedisError, OSError)


class EmbeddingIndex:
    """Index entry: a Redis hash under ``RedisKeys.embedding_index(key)`` with fields ``v`` (an
    ``EmbeddingIndexEntry``, msgpack) and ``gen``, expiring after ``ttl_s``. Only its owner writes
    it; the owner deletes it (compare-and-delete on ``gen``) BEFORE it unpins the slot, so a reader
    that pulled and then still sees its ``gen`` knows the bytes it read were the embedding
    (``still_valid``). ``lookup_live`` also checks the owner's ``alive`` key (held while its process
    runs) and drops an entry whose owner is gone.

    Lease: ``SET NX PX`` on ``RedisKeys.embedding_lease(key)`` with the holder's name; released by
    its holder (compare-and-delete) or by expiry if the holder died. A Redis error while taking it
    counts as taken (encode without coordination rather than fail)."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, *, ttl_s: int, lease_ms: int) -> None:
        self._redis = redis
        self._keys = keys
        self.ttl_s = ttl_s
        self.lease_ms = lease_ms
        self._del_if_gen = redis.register_script(_DEL_IF_GEN)
        self._del_if_owner = redis.register_script(_DEL_IF_OWNER)
        self._finish_encode = redis.register_script(_FINISH_ENCODE)
        self._lean = lean_of(redis)  # the miss path's two round trips run for every image: the lean client's
        self._dec = protocol.decoder_for(protocol.EmbeddingIndexEntry)

    # ---------------------------------------------------------------- entries
    async def publish(self, key: str, entry: protocol.EmbeddingIndexEntry) -> bool:
        name = self._keys.embedding_index(key)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(name, mapping={"v": protocol.encode(entry), "gen": str(entry.gen)})
                pipe.expire(name, self.ttl_s)
                await pipe.execute()
            return True
        except _ERRORS as exc:
            log.warning("embedding index: publish of %s failed: %s", key, exc)
            return False

    async def delete(self, key: str, gen: int) -> bool:
        """Delete the entry if it still carries ``gen``; False only when Redis failed (the
        caller must not reuse the slot yet: a reader could still validate against it)."""
        try:
            await self._del_if_gen(keys=[self._keys.embedding_index(key)], args=[str(gen)])
            return True
        except _ERRORS as exc:
            log.warning("embedding index: delete of %s failed: %s", key, exc)
            return False

    async def lookup(self, key: str) -> protocol.EmbeddingIndexEntry | None:
        try:
            raw = await self._redis.hget(self._keys.embedding_index(key), "v")
            return None if raw is None else self._dec.decode(raw)
        except _ERRORS as exc:
            log.warning("embedding index: lookup of %s failed: %s", key, exc)
            return None

    async def lookup_live(self, key: str) -> protocol.EmbeddingIndexEntry | None:
        """The entry if its owner runs now; an entry of a dead owner is dropped."""
        entry = await self.lookup(key)
        if entry is None:
            return None
        try:
            alive = await self._redis.exists(self._keys.alive(entry.owner.name))
        except _ERRORS:
            return None
        if not alive:
            await self.delete(key, entry.gen)
            return None
        return entry

    async def resolve(self, key: str) -> protocol.EmbeddingIndexEntry | None:
        """``lookup_live`` for a caller that must tell "no entry" from "Redis could not say" (the
        gateway resolving a client-named item): a Redis error raises instead of answering None."""
        raw = await self._redis.hget(self._keys.embedding_index(key), "v")
        if raw is None:
            return None
        entry = self._dec.decode(raw)
        return entry if await self._redis.exists(self._keys.alive(entry.owner.name)) else None

    async def still_valid(self, key: str, gen: int) -> bool:
        try:
            raw = await self._redis.hget(self._keys.embedding_index(key), "gen")
        except _ERRORS:
            return False
        return raw is not None and int(raw) == gen

    async def lookup_or_lease(self, key: str, holder: str) -> tuple[protocol.EmbeddingIndexEntry | None, bool]:
        """One round trip for the miss path: (the entry if one is there, whether ``holder``
        now holds the lease), read and leased atomically (MULTI: no holder's publish and
        release can fall between the two). A found entry's owner is checked for liveness as in
        ``lookup_live`` (an entry of a dead owner is dropped and reported as none). Redis
        failing answers (None, True): encode now, uncoordinated, rather than wait for a lease
        nobody can see (releasing it later is a no-op)."""
        try:
            *_, done = await self._lean.pipeline([
                ("MULTI",), ("HGET", self._keys.embedding_index(key), "v"),
                ("SET", self._keys.embedding_lease(key), holder, "NX", "PX", self.lease_ms), ("EXEC",)])
            raw, leased = done
            for reply in done:  # a command that failed inside the transaction
                if isinstance(reply, Exception):
                    raise reply
        except _ERRORS as exc:
            log.warning("embedding index: lookup/lease of %s failed (%s); encoding uncoordinated", key, exc)
            return None, True
        if raw is None:
            return None, bool(leased)
        entry = self._dec.decode(raw)
        try:
            alive = await self._redis.exists(self._keys.alive(entry.owner.name))
        except _ERRORS:
            alive = False
        if not alive:
            await self.delete(key, entry.gen)
            return None, bool(leased)
        if leased:
            await self.release_lease(key, holder)
        return entry, False

    # ---------------------------------------------------------------- coalescing lease
    async def release_lease(self, key: str, holder: str) -> None:
        try:
            await self._del_if_owner(keys=[self._keys.embedding_lease(key)], args=[holder])
        except _ERRORS as exc:
            log.warning("embedding index: lease release of %s failed (it expires): %s", key, exc)

    async def finish_encode(self, key: str, entry: protocol.EmbeddingIndexEntry | None, holder: str | None,
                            encoded: int) -> bool:
        """What follows an encode, in one round trip (one script, so in this order and at once):
        publish ``entry``, release ``holder``'s lease, count ``encoded`` items fleet-wide. Each
        part is skipped when None / 0. True when ``entry`` was written; on a Redis error nothing
        is (the lease expires, the entry is republished on a later hit)."""
        if entry is None and holder is None and not encoded:
            return False
        try:
            await self._lean.evalsha(
                self._finish_encode,
                [self._keys.embedding_index(key), self._keys.embedding_lease(key), self._keys.encoder_items()],
                [b"" if entry is None else protocol.encode(entry), 0 if entry is None else entry.gen,
                 self.ttl_s, holder or "", encoded])
            return entry is not None
        except _ERRORS as exc:
            log.warning("embedding index: the writes after encoding %s failed (%s); the lease expires", key, exc)
            return False
