"""The routing table in Redis: per prefill worker, its KV blocks, its load and the partitions of
``mm.prefill`` it owns. Written by the prefill workers, read by :class:`shared.kv.router.Router`.

Layout (keys in :class:`shared.keys.RedisKeys`, every one expiring ``kv_report_ttl_ms`` after
its worker was last heard from, so a crashed worker drops out of routing by itself):
- ``kv_load(w)``: hash ``inflight``, ``queued_tokens`` (prompt positions still to compute) and
  ``partitions`` (comma-separated), written by :class:`LoadReporter` within ``COALESCE_S`` of a
  change of load (that write alone; a change undone within it, a prompt prefilled in less,
  writes nothing), and with the owner fields and TTLs below every ``kv_report_interval_ms`` and
  on every rebalance.
- ``kv_owners(mm.prefill)``: hash partition -> worker, rewritten by the owner on assignment,
  removed (only if still its own) on revocation. A field is trusted only when the named
  worker's ``kv_load`` lists that partition too, so a stale field is never routed on.
- ``kv_blocks(w)``: set of block hashes, kept by :class:`KvTableUpdater` from ``mm.kv-events``
  (consumer group ``mmfleet.kv-table``, run by every prefill worker: the group splits the
  events' partitions among them and a survivor takes over a dead updater's share).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager

import redis.asyncio as aioredis
from aiokafka import ConsumerRebalanceListener

from shared import protocol
from shared.aio import wait_event
from shared.consume import ConsumeLoop
from shared.keys import TOPIC_KV_EVENTS, TOPIC_PREFILL, RedisKeys, consumer_group
from shared.kv.audit import lag_ops
from shared.ledger import EpochWatch
from shared.settings import Settings

log = logging.getLogger(__name__)

# Changes of load within this window are one report. A report is a Redis round trip on the
# prefill worker's loop; reported 5 ms after its start, a forward's own change of load ran its
# Python beside that forward (the two threads take turns at the GIL) and reported again at its
# end: two writes per request, the first one mid-forward. Past the window a prompt prefilled in
# less has left the load as it was, and nothing is written.
COALESCE_S = 0.025

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
    """Publishes one prefill worker's load and partitions (see the module contract). It is the
    prefill runner's rebalance listener, so ownership is rewritten on every rebalance."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, worker_id: str, load: LoadTracker,
                 settings: Settings, topic: str = TOPIC_PREFILL) -> None:
        self._redis = redis
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
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(k.kv_load(self._worker), mapping={
            "inflight": load[0], "queued_tokens": load[1], "partitions": ",".join(map(str, self._partitions))})
        pipe.pexpire(k.kv_load(self._worker), self._ttl_ms)
        if full:
            if self._partitions:
                pipe.hset(k.kv_owners(self._topic), mapping={str(p): self._worker for p in self._partitions})
            pipe.pexpire(k.kv_blocks(self._worker), self._ttl_ms)
        await pipe.execute()
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


class KvTableUpdater:
    """Applies ``mm.kv-events`` to the ``kv_blocks`` sets (see the module contract).

    Events of one worker share a key, hence a partition, hence their order. Offsets are
    committed after a batch is applied; a redelivered batch re-applies set operations, which
    at worst lists a block its worker already dropped (a lost hit, never a wrong answer).
    """

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, settings: Settings, *, doorbell=None) -> None:
        """``doorbell``: the process's :class:`shared.doorbell.Doorbell` (prefill rings it after
        producing events): without it the loop polls the broker every ``fetch_max_wait_ms``,
        which for every prefill worker of an idle fleet costs ~4 % of a core."""
        self._redis = redis
        self._keys = keys
        self._ttl_ms = settings.kv_report_ttl_ms
        self._decoder = protocol.decoder_for(protocol.KvEvent)
        self._loop = ConsumeLoop(settings, TOPIC_KV_EVENTS, consumer_group("kv-table"), name="kv-table",
                                 concurrency=256, poll_timeout_ms=500, process_batch=self._batch, doorbell=doorbell,
                                 epoch=EpochWatch(lambda: redis.get(keys.broker_epoch())))
        self.applied = 0

    def stop(self) -> None:
        self._loop.stop()

    async def run(self) -> None:
        await self._loop.run()

    async def _batch(self, records: list) -> None:
        await self.apply([rec.value for rec in records], [rec.timestamp for rec in records])

    async def apply(self, values: list[bytes], produced_ms: list[int] | None = None) -> None:
        """``produced_ms``: each record's produce timestamp, for the event-lag samples."""
        pipe = self._redis.pipeline(transaction=False)
        for raw in values:
            try:
                ev = self._decoder.decode(raw)
            except Exception as exc:  # msgspec.DecodeError: not ours to fix; skip it loudly
                log.warning("kv-table: undecodable event skipped: %r", exc)
                continue
            key = self._keys.kv_blocks(ev.worker_id)
            if ev.cleared:  # the worker's cache was emptied (or its events resynchronised)
                pipe.delete(key)
            if ev.stored:
                pipe.sadd(key, *map(str, ev.stored))
            if ev.removed:
                pipe.srem(key, *map(str, ev.removed))
            pipe.pexpire(key, self._ttl_ms)
            self.applied += 1
        now_ms = time.time() * 1000
        lag_ops(pipe, self._keys, [max(0.0, now_ms - t) for t in produced_ms or [] if t and t > 0])
        await pipe.execute()
