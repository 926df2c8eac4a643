"""The routing table in Redis, written by the prefill workers, read by
:class:`shared.kv.router.Router`. Per worker ``w`` (every key expiring ``kv_report_ttl_ms`` after
its worker was last heard from, so a crashed worker drops out by itself): ``kv_load(w)``, a hash
of ``inflight``, ``queued_tokens`` and ``partitions`` (:class:`LoadReporter`); ``kv_blocks(w)``,
the set of block hashes its prefix cache holds (:class:`TableWriter`). ``kv_owners(mm.prefill)``:
partition -> worker, trusted only when that worker's ``kv_load`` lists the partition too, so a
stale field is never routed on.

Design: docs/design/kv-routing.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager

import redis.asyncio as aioredis
from aiokafka import ConsumerRebalanceListener

from shared.keys import TOPIC_PREFILL, RedisKeys
from shared.kv.audit import LAG_SAMPLES, MAX_PENDING, NOTE_TTL_S, lag_ops
from shared.kv.prefix_cache import CacheChanges
from shared.process.aio import wait_event
from shared.settings import Settings
from shared.transport.redis_lean import lean_of

log = logging.getLogger(__name__)

# Changes of load within this window are one report. A report is a Redis round trip on the
# prefill worker's loop; reported 5 ms after its start, a forward's own change of load ran its
# Python beside that forward (the two threads take turns at the GIL) and reported again at its
# end: two writes per request, the first one mid-forward. Past the window a prompt prefilled in
# less has left the load as it was, and nothing is written.
COALESCE_S = 0.025
# after a failed table write: the first retry, doubled per failure up to the last
_RETRY_S, _RETRY_MAX_S = 0.1, 5.0

# delete an owner field only if it still names us (the new owner may have written it already)
_HDEL_IF_MINE = """
for i, f in ipairs(ARGV) do
  if i > 1 and redis.call('hget', KEYS[1], f) == ARGV[1] then redis.call('hdel', KEYS[1], f) end
end
return 0
"""


class LoadTracker:
    """In-process counters of a prefill worker's work: requests in flight and prompt positions
    they still have to compute (the handler tracks each request, the reporter publishes)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.queued_tokens = 0
        # set on every change: the reporter publishes at once, so the table never shows work
        # that is already done (a stale load would steer a follow-up turn away from its KV)
        self.changed = asyncio.Event()

    def snapshot(self) -> tuple[int, int]:
        return self.inflight, self.queued_tokens

    @contextmanager
    def track(self, tokens: int):
        self.inflight += 1
        self.queued_tokens += tokens
        self.changed.set()
        try:
            yield
        finally:
            self.inflight -= 1
            self.queued_tokens -= tokens
            self.changed.set()


class LoadReporter(ConsumerRebalanceListener):
    """Publishes one prefill worker's load and partitions. It is the prefill runner's rebalance
    listener, so ownership is rewritten on every rebalance. ``kv_load`` is written within
    ``COALESCE_S`` of a change of load (that write alone; a change undone within it, a prompt
    prefilled in less, writes nothing), and with the ``kv_owners`` fields and TTLs every
    ``kv_report_interval_ms`` and on every rebalance. A partition's owner field is rewritten on
    assignment and removed (only if still its own) on revocation."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, worker_id: str, load: LoadTracker,
                 settings: Settings, topic: str = TOPIC_PREFILL) -> None:
        self._redis = redis
        self._lean = lean_of(redis)  # writes per prefill: the lean client's pipelines
        self._keys = keys
        self._worker = worker_id
        self._load = load
        self._topic = topic
        self._interval_s = settings.kv_report_interval_ms / 1000
        self._ttl_ms = settings.kv_report_ttl_ms
        self._partitions: tuple[int, ...] = ()
        self._reported: tuple[int, int] | None = None  # the load the table holds (last written)
        self._hdel = redis.register_script(_HDEL_IF_MINE)

    # ConsumerRebalanceListener: awaited by aiokafka inside the rebalance
    async def on_partitions_revoked(self, revoked) -> None:
        gone = [tp.partition for tp in revoked if tp.topic == self._topic]
        self._partitions = tuple(p for p in self._partitions if p not in gone)
        try:
            if gone:
                await self._hdel(keys=[self._keys.kv_owners(self._topic)], args=[self._worker, *map(str, gone)])
            await self.report()
        except Exception as exc:  # Redis trouble must not break the consumer group
            log.warning("kv: could not record revoked partitions %s: %r", gone, exc)

    async def on_partitions_assigned(self, assigned) -> None:
        self._partitions = tuple(sorted(tp.partition for tp in assigned if tp.topic == self._topic))
        log.info("kv: %s owns %s partitions %s", self._worker, self._topic, list(self._partitions))
        try:
            await self.report()
        except Exception as exc:
            log.warning("kv: could not record assigned partitions %s: %r", self._partitions, exc)

    async def report(self, *, full: bool = True) -> None:
        """The load; with ``full`` also the owner fields and the blocks' TTL (a change of load
        alone needs none of them: they change on rebalances, which report in full)."""
        k = self._keys
        load = self._load.snapshot()
        cmds: list[tuple] = [
            ("HSET", k.kv_load(self._worker), "inflight", load[0], "queued_tokens", load[1],
             "partitions", ",".join(map(str, self._partitions))),
            ("PEXPIRE", k.kv_load(self._worker), self._ttl_ms)]
        if full:
            if self._partitions:
                owners = (x for p in self._partitions for x in (p, self._worker))  # partition -> worker
                cmds.append(("HSET", k.kv_owners(self._topic), *owners))
            cmds.append(("PEXPIRE", k.kv_blocks(self._worker), self._ttl_ms))
        await self._lean.pipeline(cmds)
        self._reported = load

    async def run(self) -> None:
        """Refresh until cancelled; on the way out remove this worker from the table."""
        loop = asyncio.get_running_loop()
        try:
            full_at = 0.0  # loop.time() of the next full report (the TTL refresh)
            while True:
                self._load.changed.clear()  # a change during the report triggers the next one
                full = loop.time() >= full_at
                try:
                    if full or self._load.snapshot() != self._reported:
                        await self.report(full=full)
                    if full:
                        full_at = loop.time() + self._interval_s
                except (aioredis.RedisError, OSError) as exc:
                    log.warning("kv: load report failed: %r", exc)
                # on a change of load, else when the full report is due
                await wait_event(self._load.changed, full_at - loop.time())
                await asyncio.sleep(COALESCE_S)  # a burst of changes is one report
        finally:
            await asyncio.shield(self._withdraw())

    async def _withdraw(self) -> None:
        k = self._keys
        try:
            await self._redis.delete(k.kv_load(self._worker), k.kv_blocks(self._worker))
            if self._partitions:
                await self._hdel(keys=[k.kv_owners(self._topic)], args=[self._worker, *map(str, self._partitions)])
        except Exception as exc:
            log.warning("kv: could not withdraw %s from the routing table: %r", self._worker, exc)


class TableWriter:
    """A prefill worker's writes to the routing table that need no answer: its ``kv_blocks`` set
    and the route notes (:class:`shared.kv.audit.RouteAudit`), a loop turn or a write's round trip
    after its cache changed.

    Changes are folded into what is pending and written by one task, in order, one pipeline a
    write; what comes during a write goes in the next. Redis trouble is logged, never raised: a
    failed write leaves the set dirty, and the next write replaces it whole from the blocks the
    cache holds (mirrored here from the changes), so no change is lost to a Redis outage."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, worker_id: str, settings: Settings) -> None:
        self._redis = redis
        self._lean = lean_of(redis)  # writes per prefill: the lean client's pipelines
        self._keys = keys
        self._worker = worker_id
        self._ttl_ms = settings.kv_report_ttl_ms
        self._held: set[int] = set()  # what the cache holds: the whole set, for a rewrite
        self._stored: set[int] = set()  # pending, disjoint from _removed
        self._removed: set[int] = set()
        self._rewrite = True  # the first write replaces whatever a previous life of this id left
        self._changed_ms: list[float] = []  # when each pending change was made (lag samples)
        self._notes: list[tuple[str, bytes]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.written = 0  # writes that reached Redis, for tests and stats
        self._failures = 0  # consecutive failed writes

    def changed(self, changes: CacheChanges) -> None:
        """The worker's cache changed: ``cleared`` (applied first), ``stored``, ``removed``."""
        if not changes:
            return
        if changes.cleared:
            self._held.clear()
            self._stored.clear()
            self._removed.clear()
            self._rewrite = True
        for h in changes.stored:
            self._held.add(h)
            self._removed.discard(h)
            self._stored.add(h)
        for h in changes.removed:
            self._held.discard(h)
            self._stored.discard(h)
            self._removed.add(h)
        if len(self._changed_ms) < LAG_SAMPLES:
            self._changed_ms.append(time.time() * 1000)
        self._kick()

    def note(self, key: str, value: bytes) -> bool:
        """Queue a route note (written as one JSON value with a TTL); False when ``MAX_PENDING``
        notes are already waiting (the note is dropped: notes are advisory)."""
        if len(self._notes) >= MAX_PENDING:
            return False
        self._notes.append((key, value))
        self._kick()
        return True

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until nothing queued is left unwritten; False if that took over ``timeout_s``
        (Redis away: the writer keeps trying)."""
        return await wait_event(self._idle, timeout_s)

    async def run(self) -> None:
        """Write until cancelled; then one last write of what is pending."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._write()
                if not self._wake.is_set():
                    self._idle.set()
        finally:
            await asyncio.shield(self._write())
            self._idle.set()

    async def _write(self) -> None:
        if not (self._rewrite or self._stored or self._removed or self._notes):
            return
        key = self._keys.kv_blocks(self._worker)
        rewrite, stored, removed = self._rewrite, self._stored, self._removed
        notes, changed_ms = self._notes, self._changed_ms
        self._rewrite, self._stored, self._removed, self._notes, self._changed_ms = False, set(), set(), [], []
        cmds: list[tuple] = []
        if rewrite:
            cmds.append(("DEL", key))
            stored, removed = self._held, set()
        if stored:
            cmds.append(("SADD", key, *stored))
        if removed:
            cmds.append(("SREM", key, *removed))
        if rewrite or stored or removed:
            cmds.append(("PEXPIRE", key, self._ttl_ms))
        for note_key, value in notes:
            cmds.append(("SET", note_key, value, "EX", NOTE_TTL_S))
        now_ms = time.time() * 1000
        cmds += lag_ops(self._keys, [max(0.0, now_ms - t) for t in changed_ms])
        try:
            await self._lean.pipeline(cmds)
        except (aioredis.RedisError, OSError) as exc:
            # the set may now miss changes: the next write replaces it whole (notes are advisory)
            self._failures += 1
            (log.warning if self._failures == 1 else log.debug)(
                "kv: routing-table write failed (%r); the next one rewrites %s's blocks", exc, self._worker)
            self._rewrite = True
            self._kick()
            # Redis away: not a write attempt per change
            await asyncio.sleep(min(_RETRY_S * 2 ** (self._failures - 1), _RETRY_MAX_S))
            return
        if self._failures:
            log.info("kv: routing-table writes of %s work again (%d failed)", self._worker, self._failures)
            self._failures = 0
        self.written += 1
