"""The one Kafka consume loop (:class:`ConsumeLoop`): fetch → process → commit the watermark of
what is done, for every consumer of the fleet (the stage runner and the Kafka ingress).
Bounded (at most ``concurrency`` records in flight; beyond it the partitions are paused and the
backlog stays in Kafka); at-least-once (an offset is committed only once every record below it
is processed, :class:`OffsetTracker`); every (re)assigned partition, and every partition after a
broker restart that lost its records (:class:`~shared.transport.ledger.EpochWatch`), starts with a fresh
watermark; ``stop()`` drains for ``drain_timeout_ms``, and what is left is redelivered.

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from shared import metrics
from shared.process.aio import wait_event
from shared.settings import Settings
from shared.transport.bus import make_consumer
from shared.transport.ledger import EpochWatch

log = logging.getLogger(__name__)

_LAG_INTERVAL_S = 1.0  # consumer-lag gauge refresh; position() is local once fetching
# A commit still unanswered after this is abandoned (the next one covers its records). aiokafka
# retries a commit until a coordinator answers, so unbounded, one decided before a broker restart
# would land on the new broker with offsets of the old one (tansu stores it even from a member it
# no longer knows), and whoever is assigned that partition next would skip the records below it.
# `mmfleet up` announces a restart (the broker epoch) and waits BROKER_RESTART_GRACE_MS, longer
# than this, before it starts the new broker; a commit decided after the announcement sees it.
COMMIT_TIMEOUT_MS = 1_000
BROKER_RESTART_GRACE_MS = 2 * COMMIT_TIMEOUT_MS + 500

Process = Callable[[TopicPartition, object], Awaitable[None]]
ProcessBatch = Callable[[list], Awaitable[None]]


class OffsetTracker:
    """Which offset of one partition may be committed, given out-of-order completion.

    Kafka commits are a watermark: committing N says every offset below N is done. With
    concurrent handlers finishing in any order, the watermark is the smallest offset still in
    flight (or one past the highest finished when none are).
    """

    def __init__(self) -> None:
        self._in_flight: set[int] = set()
        self._highest_done = -1
        self._committed = -1

    def begin(self, offset: int) -> None:
        self._in_flight.add(offset)

    def done(self, offset: int) -> None:
        self._in_flight.discard(offset)
        self._highest_done = max(self._highest_done, offset)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def committable(self) -> int | None:
        """Next offset to commit, or None when nothing new is safe to commit."""
        mark = min(self._in_flight) if self._in_flight else self._highest_done + 1
        return mark if mark > self._committed and mark > 0 else None

    def mark_committed(self, offset: int) -> None:
        self._committed = max(self._committed, offset)


class ConsumeLoop:
    """One consumer group member over ``topic``.

    ``process(tp, record)``: one record, run as its own task; an exception escaping it is a
    fault of the consumer itself (e.g. the broker is gone): logged, and the loop stops (the
    record stays uncommitted) and ``run()`` raises it once drained. ``process_batch(records)``
    instead: each fetched batch is processed in order, inline. ``lag_label``: publish
    ``mmfleet_consumer_lag_records`` under it.
    """

    def __init__(self, settings: Settings, topic: str, group: str, *, name: str, concurrency: int,
                 poll_timeout_ms: int, process: Process | None = None, process_batch: ProcessBatch | None = None,
                 listener: ConsumerRebalanceListener | None = None, epoch: EpochWatch | None = None,
                 doorbell=None, lag_label: str | None = None) -> None:
        self.name = name
        self.topic = topic
        self._settings = settings
        self._concurrency = concurrency
        self._poll_timeout_ms = poll_timeout_ms
        self._process_one = process
        self._process_batch = process_batch
        self._epoch = epoch
        self._doorbell = doorbell  # shared.transport.doorbell.Doorbell: idle waits that an upstream produce cuts short
        self._consumer = make_consumer(settings, topic, group, listener=_Rebalance(self, listener),
                                       fetch_max_wait_ms=1 if doorbell is not None else None)
        self._trackers: dict[TopicPartition, OffsetTracker] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._paused = False
        self._commit_wanted = asyncio.Event()
        self._lag_label = lag_label
        self._lag_next = 0.0
        self._lag_partitions: set[int] = set()
        self.processed = 0  # records finished, for stats and tests
        self._fatal: BaseException | None = None  # the first record error that stopped the loop
        self.assigned = asyncio.Event()  # set while the group gives this consumer partitions
        self.on_revoked: Callable[[set[int]], None] | None = None  # partitions taken away (before they go)

    def owns(self, partition: int) -> bool:
        """Whether this consumer has ``partition`` of its topic and is not pausing it."""
        return not self._paused and any(tp.partition == partition for tp in self._consumer.assignment())

    def free(self) -> int:
        """Records it may still take on under ``concurrency``."""
        return self._concurrency - len(self._tasks)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Consume until ``stop()``; then drain, commit and close; raises a fatal record error."""
        await self._consumer.start()
        if self._doorbell is not None:
            self._doorbell.attach(self._consumer, self.topic)
        committer = asyncio.create_task(self._commit_loop(), name=f"{self.name}-commit")
        try:
            while not self._stopping.is_set():
                free = self._concurrency - len(self._tasks)
                self._set_paused(free <= 0)
                batch = await self._consumer.getmany(timeout_ms=self._poll_timeout_ms, max_records=max(free, 1))
                if self._consumer.assignment():
                    self.assigned.set()
                else:
                    self.assigned.clear()
                if self._lag_label is not None:
                    await self._update_lag()
                if self._process_batch is not None:
                    await self._run_batch(batch)
                    continue
                for tp, records in batch.items():
                    tracker = self._trackers.setdefault(tp, OffsetTracker())
                    for rec in records:
                        tracker.begin(rec.offset)
                        task = asyncio.create_task(self._one(tp, tracker, rec))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
        finally:
            await self._drain()
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)
            await self._commit()
            await self._consumer.stop()
            for partition in self._lag_partitions:
                metrics.CONSUMER_LAG.remove(self._lag_label, str(partition))
            self._lag_partitions.clear()
        if self._fatal is not None:  # the process exits non-zero: its supervisor restarts it
            raise self._fatal

    async def _one(self, tp: TopicPartition, tracker: OffsetTracker, rec) -> None:
        """``tracker``: the partition's tracker when the record was fetched; a rebalance since
        replaced it, so a record of a partition given away never moves the new watermark."""
        try:
            await self._process_one(tp, rec)
        except asyncio.CancelledError:
            raise  # shutdown: leave the offset uncommitted
        except Exception as exc:
            log.exception("%s: fatal error at %s:%d", self.name, tp.partition, rec.offset)
            self._fatal = self._fatal or exc
            self.stop()
            return
        tracker.done(rec.offset)
        self.processed += 1
        self._commit_wanted.set()

    async def _run_batch(self, batch: dict) -> None:
        records = [rec for recs in batch.values() for rec in recs]
        if not records:
            return
        for tp, recs in batch.items():
            tracker = self._trackers.setdefault(tp, OffsetTracker())
            for rec in recs:
                tracker.begin(rec.offset)
        await self._process_batch(records)
        for tp, recs in batch.items():
            tracker = self._trackers.get(tp)
            for rec in recs if tracker is not None else ():
                tracker.done(rec.offset)
        self.processed += len(records)
        self._commit_wanted.set()

    async def _drain(self) -> None:
        if not self._tasks:
            return
        log.info("%s: draining %d in-flight records", self.name, len(self._tasks))
        _done, pending = await asyncio.wait(set(self._tasks), timeout=self._settings.drain_timeout_ms / 1000)
        for task in pending:  # not committed: the group redelivers them
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _set_paused(self, paused: bool) -> None:
        if paused == self._paused:
            return
        parts = list(self._consumer.assignment())
        if paused:
            self._consumer.pause(*parts)
        else:
            self._consumer.resume(*parts)
        self._paused = paused

    async def _update_lag(self) -> None:
        """``mmfleet_consumer_lag_records`` for each assigned partition (highwater - position);
        partitions no longer assigned lose their series."""
        now = time.monotonic()
        if now < self._lag_next:
            return
        self._lag_next = now + _LAG_INTERVAL_S
        seen = set()
        for tp in self._consumer.assignment():
            high = self._consumer.highwater(tp)
            if high is None:  # no fetch answered for it yet
                continue
            try:
                position = await asyncio.wait_for(self._consumer.position(tp), 0.5)
            except (TimeoutError, KafkaError, AssertionError, ValueError):
                continue  # rebalancing: the next refresh has it
            metrics.CONSUMER_LAG.labels(self._lag_label, str(tp.partition)).set(max(high - position, 0))
            seen.add(tp.partition)
        for partition in self._lag_partitions - seen:
            metrics.CONSUMER_LAG.remove(self._lag_label, str(partition))
        self._lag_partitions = seen

    # ------------------------------------------------------------------ commits
    async def _commit_loop(self) -> None:
        while True:
            # at least once a second, so an idle consumer notices a broker restart too
            await wait_event(self._commit_wanted, 1.0)
            self._commit_wanted.clear()
            await self._commit()
            await asyncio.sleep(self._settings.commit_interval_ms / 1000)  # completions meanwhile: one commit

    async def _broker_restarted(self) -> bool:
        """True once per change of the broker epoch: every watermark is stale then (offsets
        start at 0 again), so they are dropped, nothing is committed, and every partition is
        read again from its beginning (the ledger skips what is done). Checked right before each
        commit, so a stale watermark never reaches the new broker: the epoch changes
        ``BROKER_RESTART_GRACE_MS`` before that broker starts, and a commit decided earlier is
        abandoned after ``COMMIT_TIMEOUT_MS``."""
        if self._epoch is None or not await self._epoch.changed():
            return False
        log.warning("%s: the broker lost its records (restarted); reading every partition again", self.name)
        self._trackers.clear()
        parts = list(self._consumer.assignment())
        if parts:
            await self._consumer.seek_to_beginning(*parts)
        return True

    async def _commit(self) -> None:
        if await self._broker_restarted():
            return
        offsets, trackers = {}, {}
        assigned = self._consumer.assignment()
        for tp, tracker in list(self._trackers.items()):
            mark = tracker.committable()
            if mark is not None and tp in assigned:
                offsets[tp], trackers[tp] = mark, tracker
        if not offsets:
            return
        try:
            await asyncio.wait_for(self._consumer.commit(offsets), COMMIT_TIMEOUT_MS / 1000)
        except TimeoutError:  # the broker is away: never let this commit reach a restarted one
            log.warning("%s: commit unanswered after %d ms; abandoned (the next one covers it)",
                        self.name, COMMIT_TIMEOUT_MS)
            return
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partition: its new owner re-processes from the last commit
            # (handlers are idempotent), so this is a duplicate, never a loss.
            log.warning("%s: commit failed (%s); records will be redelivered", self.name, exc)
            return
        for tp, mark in offsets.items():
            trackers[tp].mark_committed(mark)


class _Rebalance(ConsumerRebalanceListener):
    """Commit finished work before partitions go; start every (re)assigned partition with a
    fresh watermark. A tracker kept across a rebalance could commit a stale offset: after the
    embedded broker restarts empty, offsets start at 0 again, and an old watermark would commit
    past records nobody has processed."""

    def __init__(self, loop: ConsumeLoop, also: ConsumerRebalanceListener | None = None) -> None:
        self._loop = loop
        self._also = also  # the consumer's own listener (prefill: partition ownership for routing)

    async def on_partitions_revoked(self, revoked) -> None:
        if self._loop.on_revoked is not None:
            self._loop.on_revoked({tp.partition for tp in revoked})
        await self._loop._commit()
        for tp in revoked:
            self._loop._trackers.pop(tp, None)
        if self._also is not None:
            await self._also.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            self._loop._trackers.pop(tp, None)
        if self._also is not None:
            await self._also.on_partitions_assigned(assigned)
