"""The one generic stage runner: consume → handle → produce → release → commit.

Every stage gets the same semantics: at-least-once (commit after the outputs are acked),
bounded (``concurrency`` in flight, partitions paused beyond), deadlines (504 without work),
idempotent under a ``StageLedger`` claim, restarts from the source on a lost tensor owner,
retries then dead-letter on faults, a bounded drain on ``stop()``, and (with a doorbell)
client-side idle waits that an upstream produce cuts short. Each rule, and why:
docs/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from shared import logs, metrics, protocol, tracing
from shared.bus import OffsetTracker, make_consumer, send_retrying
from shared.keys import TOPIC_DEAD_LETTER, TOPIC_PREFILL, consumer_group
from shared.ledger import ABORTED, CLAIMED, DONE, HELD
from shared.settings import Settings
from shared.stage import Context, Handler, Outcome, Produce, RequestFailed, entry_message
from shared.transfer import OwnerGoneError

log = logging.getLogger(__name__)

_LAG_INTERVAL_S = 1.0  # consumer-lag gauge refresh; position() is local once fetching


def now_ms() -> int:
    return int(time.time() * 1000)


class StageRunner:
    """Drives one handler from one topic. The producer and context are shared per process."""

    def __init__(self, *, stage: str, topic: str, union: object, handler: Handler, ctx: Context,
                 producer, settings: Settings, concurrency: int | None = None,
                 local_routes: dict[str, tuple[Handler, Context]] | None = None, router=None,
                 rebalance_listener=None, doorbell=None) -> None:
        self.stage = stage
        self.topic = topic
        self._decoder = protocol.decoder_for(union)
        self._handler = handler
        self._ctx = ctx
        self._local = local_routes or {}
        self._producer = producer
        self._settings = settings
        self._concurrency = concurrency or settings.stage_concurrency
        self._router = router  # shared.kv.router.Router: picks mm.prefill partitions (None: by key)
        self._doorbell = doorbell  # shared.doorbell.Doorbell: rung after produces, wakes this consumer
        self._consumer = make_consumer(settings, topic, consumer_group(stage),
                                       listener=_Rebalance(self, rebalance_listener),
                                       fetch_max_wait_ms=1 if doorbell is not None else None)
        self._trackers: dict[TopicPartition, OffsetTracker] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._paused = False
        self._commit_wanted = asyncio.Event()
        self._epoch: bytes | None = None  # broker-epoch token last seen (see _broker_restarted)
        self.processed = 0  # records finished (any outcome), for stats and tests
        self.assigned = asyncio.Event()  # set once the group gave this runner partitions
        self._lag_next = 0.0
        self._lag_partitions: set[int] = set()

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        """Consume until ``stop()``; then drain and close. Raises on a fatal consumer error."""
        await self._consumer.start()
        if self._doorbell is not None:
            self._doorbell.attach(self._consumer, self.topic)
        committer = asyncio.create_task(self._commit_loop(), name=f"{self.stage}-commit")
        try:
            while not self._stopping.is_set():
                free = self._concurrency - len(self._tasks)
                self._set_paused(free <= 0)
                batch = await self._consumer.getmany(
                    timeout_ms=self._settings.fetch_max_wait_ms + 100, max_records=max(free, 1)
                )
                if self._consumer.assignment():
                    self.assigned.set()
                else:
                    self.assigned.clear()
                await self._update_lag()
                for tp, records in batch.items():
                    tracker = self._trackers.setdefault(tp, OffsetTracker())
                    for rec in records:
                        tracker.begin(rec.offset)
                        task = asyncio.create_task(self._process(tp, tracker, rec))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
        finally:
            await self._drain()
            committer.cancel()
            await asyncio.gather(committer, return_exceptions=True)
            await self._commit()
            await self._consumer.stop()
            for partition in self._lag_partitions:
                metrics.CONSUMER_LAG.remove(self.stage, str(partition))
            self._lag_partitions.clear()

    def stop(self) -> None:
        self._stopping.set()

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
            metrics.CONSUMER_LAG.labels(self.stage, str(tp.partition)).set(max(high - position, 0))
            seen.add(tp.partition)
        for partition in self._lag_partitions - seen:
            metrics.CONSUMER_LAG.remove(self.stage, str(partition))
        self._lag_partitions = seen

    async def _drain(self) -> None:
        if not self._tasks:
            return
        log.info("%s: draining %d in-flight records", self.stage, len(self._tasks))
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

    # ------------------------------------------------------------------ one record
    async def _process(self, tp: TopicPartition, tracker: OffsetTracker, rec) -> None:
        """``tracker``: the partition's tracker when the record was fetched; a rebalance since
        replaced it, so a record of a partition given away never moves the new watermark."""
        try:
            await self._handle_record(tp, rec)
            tracker.done(rec.offset)
            self.processed += 1
            self._commit_wanted.set()
        except asyncio.CancelledError:
            raise  # shutdown: leave the offset uncommitted
        except Exception:  # the runner itself failed (e.g. broker gone): stop loudly
            log.exception("%s: fatal error at %s:%d", self.stage, tp.partition, rec.offset)
            self.stop()

    async def _handle_record(self, tp: TopicPartition, rec) -> None:
        try:
            msg = self._decoder.decode(rec.value)
        except msgspec.DecodeError as exc:
            # Undecodable: no request id to answer to; keep it for an operator.
            with logs.bind(stage=self.stage):
                log.warning("undecodable record at %s:%d: %s", tp.partition, rec.offset, exc)
            await self._dead_letter(tp, rec, f"undecodable record: {exc}", attempts=1)
            self._count("dead_letter")
            return
        with logs.bind(request_id=msg.meta.request_id, stage=self.stage):
            await self._handle_decoded(tp, rec, msg)

    def _count(self, outcome: str) -> None:
        metrics.STAGE_RECORDS.labels(self.stage, outcome).inc()

    async def _handle_decoded(self, tp: TopicPartition, rec, msg) -> None:
        meta: protocol.RequestMeta = msg.meta
        queue_ms = now_ms() - rec.timestamp  # producer CreateTime → picked up here
        ledger = self._ctx.ledger
        if ledger is None:
            await self._attempts(tp, rec, msg, meta, queue_ms)
            return
        t_claim = time.perf_counter()
        state = await self._claim(meta)
        if state == ABORTED:
            await self._fail(meta, RequestFailed(499, "the client closed the request", type_="invalid_request_error",
                                                 code="client_closed_request"), outcome="aborted")
            return
        if state == DONE:
            log.debug("%s: %s is done already; skipping the redelivery", self.stage, meta.request_id)
            self._count("duplicate")
            return  # done already (or by the live worker that held the claim)
        claim_ms = (time.perf_counter() - t_claim) * 1000  # Redis round trips before the work
        keeper = asyncio.create_task(self._keep_claim(meta))
        finished = False
        try:
            await self._attempts(tp, rec, msg, meta, queue_ms, claim_ms)
            keeper.cancel()
            await ledger.finish(meta.request_id, self.stage, meta.attempt, self._ctx.worker_id)
            finished = True
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            if not finished:
                await ledger.release(meta.request_id, self.stage, meta.attempt, self._ctx.worker_id)

    async def _claim(self, meta: protocol.RequestMeta) -> int:
        """Claim (request, stage, attempt) in one Redis round trip: ``ABORTED``, ``DONE`` or
        ``CLAIMED``. Waits while another worker holds the claim (it lapses within the lease if
        that worker died); past the deadline it answers ``CLAIMED`` unclaimed, and the
        deadline check ends the record with a 504."""
        ledger = self._ctx.ledger
        while True:
            state = await ledger.enter(meta.request_id, self.stage, meta.attempt, self._ctx.worker_id)
            if state != HELD:
                return state
            if now_ms() > meta.deadline_unix_ms:
                return CLAIMED
            await asyncio.sleep(0.2)

    async def _keep_claim(self, meta: protocol.RequestMeta) -> None:
        ledger = self._ctx.ledger
        while True:
            await asyncio.sleep(ledger.lease_ms / 3000)
            await ledger.refresh(meta.request_id, self.stage, meta.attempt, self._ctx.worker_id)

    async def _attempts(self, tp: TopicPartition, rec, msg, meta: protocol.RequestMeta, queue_ms: float,
                        claim_ms: float = 0.0) -> None:
        attempts = 0
        while True:
            attempts += 1
            if now_ms() > meta.deadline_unix_ms:
                await self._fail(meta, RequestFailed.deadline(meta.request_id, self.stage))
                return
            try:
                outcome = await self._run_stage(self._handler, msg, self._ctx, queue_ms, claim_ms)
            except RequestFailed as failed:
                await self._fail(meta, failed)
                return
            except OwnerGoneError as exc:
                log.warning("%s: %s lost an input tensor (%s); restarting it from its source", self.stage,
                            meta.request_id, exc)
                try:
                    fresh = None
                    if self._ctx.ledger is not None and meta.attempt < self._settings.max_restarts:
                        fresh = await self._ctx.ledger.next_attempt(meta.request_id, meta.attempt)
                    outcome = restart_from_source(meta, self._settings.max_restarts, str(exc), fresh)
                except RequestFailed as failed:
                    await self._fail(meta, failed)
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("%s: handler failed for %s (attempt %d)", self.stage, meta.request_id, attempts)
                if attempts >= self._settings.max_attempts:
                    await self._dead_letter(tp, rec, f"{type(exc).__name__}: {exc}", attempts)
                    await self._fail(meta, RequestFailed(
                        500, f"stage {self.stage} failed {attempts} times on this request; it was "
                             f"moved to {TOPIC_DEAD_LETTER}", type_="server_error", code="stage_failed"),
                        outcome="dead_letter")
                    return
                await asyncio.sleep(min(0.05 * 2 ** attempts, 2.0))
                continue
            try:
                await self._deliver(outcome, meta.deadline_unix_ms)
            except KafkaError as exc:  # the broker stayed unreachable until the deadline
                await self._fail(meta, RequestFailed(503, f"stage {self.stage} could not queue its output before "
                                                          f"the deadline ({type(exc).__name__})",
                                                     type_="server_error", code="queue_unavailable"))
                return
            self._count("ok")
            log.debug("%s: handled %s (%d outputs)", self.stage, meta.request_id, len(outcome.produce))
            return

    async def _run_stage(self, handler: Handler, msg, ctx: Context, queue_ms: float,
                         claim_ms: float = 0.0) -> Outcome:
        """One handler call under its stage span; its outputs carry the span; outputs for
        local stages are handled here too (queue 0), and only the rest goes to Kafka."""
        with tracing.stage_span(ctx.stage, ctx.worker_id, queue_ms, claim_ms) as timer:
            try:
                with logs.bind(stage=ctx.stage):  # a locally routed stage logs under its own name
                    outcome = await handler.handle(msg, ctx)
            finally:  # failed calls are observed too: their time was spent all the same
                span = timer.span()
                metrics.observe_span(span.stage, span.queue_ms, span.transfer_ms, span.total_ms)
        produce, releases = [], list(outcome.releases)
        for p in outcome.produce:
            value = tracing.stamp(p.value, span) if hasattr(p.value, "meta") else p.value  # KV events: no meta
            route = self._local.get(p.topic)
            if route is None:
                produce.append(Produce(p.topic, p.key, value, p.partition))
                continue
            sub = await self._run_stage(route[0], value, route[1], 0.0)
            produce.extend(sub.produce)
            releases.extend(sub.releases)
        return Outcome(produce, releases)

    async def _deliver(self, outcome: Outcome, deadline_unix_ms: int) -> None:
        """Produce the outputs (all sent at once; mm.prefill records to the partition the router
        picks), wait for every broker ack (the output is durable before anything upstream is
        freed), retrying broker errors until the deadline."""
        sends = []
        for p in outcome.produce:
            value = protocol.encode(p.value)
            partition = await self._partition(p)
            try:
                fut = await self._producer.send(p.topic, value, key=p.key.encode(), partition=partition)
            except KafkaError:
                fut = None  # not even queued (e.g. no metadata for the topic yet): retried below
            sends.append((p, value, partition, fut))
        for p, value, partition, fut in sends:
            await send_retrying(self._producer, p.topic, value, p.key.encode(), deadline_unix_ms=deadline_unix_ms,
                                first_try=fut, partition=partition)
        if self._doorbell is not None:  # acked: wake the next stage's idle consumers now
            for topic in {p.topic for p in outcome.produce}:
                self._doorbell.ring(topic)
        if self._ctx.transfer is not None:
            for owner, leases in outcome.releases:
                await self._ctx.transfer.release(owner, leases)

    async def _partition(self, p: Produce) -> int | None:
        if p.partition is None and p.topic == TOPIC_PREFILL and self._router is not None:
            return await self._router.partition_for(p.value)
        return p.partition

    async def _fail(self, meta: protocol.RequestMeta, failed: RequestFailed, outcome: str | None = None) -> None:
        """Write the request's terminal error; count ``outcome`` (default: deadline for a 504,
        else failed)."""
        log.info("%s: request %s failed: %s", self.stage, meta.request_id, failed.event.message)
        await self._ctx.events.append(meta.request_id, failed.event)
        self._count(outcome or ("deadline" if failed.event.status == 504 else "failed"))

    async def _dead_letter(self, tp: TopicPartition, rec, error: str, attempts: int) -> None:
        letter = protocol.DeadLetter(topic=tp.topic, partition=tp.partition, offset=rec.offset,
                                     error=error[:4000], attempts=attempts, value=rec.value)
        await self._producer.send_and_wait(TOPIC_DEAD_LETTER, protocol.encode(letter), key=rec.key)

    # ------------------------------------------------------------------ commits
    async def _commit_loop(self) -> None:
        while True:
            try:  # at least once a second, so an idle runner notices a broker restart too
                await asyncio.wait_for(self._commit_wanted.wait(), 1.0)
            except TimeoutError:
                pass
            self._commit_wanted.clear()
            await self._commit()
            await asyncio.sleep(0.005)  # coalesce bursts of completions into one commit

    async def _broker_restarted(self) -> bool:
        """True once per change of the broker-epoch token (a broker that lost its records came
        back): every watermark is stale then (offsets start at 0 again), so they are dropped,
        nothing is committed, and every partition is read again from its beginning (the ledger
        skips what is done). Checked right before each commit, so a stale watermark never
        reaches the new broker: the epoch changes before the topics exist again."""
        if self._ctx.ledger is None:
            return False
        try:
            epoch = await self._ctx.ledger.broker_epoch()
        except Exception:  # Redis away: commits go on as before
            return False
        if epoch is None or epoch == self._epoch:
            return False
        first, self._epoch = self._epoch is None, epoch
        if first:
            return False
        log.warning("%s: the broker lost its records (restarted); reading every partition again", self.stage)
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
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partition: its new owner re-processes from the last commit
            # (handlers are idempotent), so this is a duplicate, never a loss.
            log.warning("%s: commit failed (%s); records will be redelivered", self.stage, exc)
            return
        for tp, mark in offsets.items():
            trackers[tp].mark_committed(mark)


class _Rebalance(ConsumerRebalanceListener):
    """Commit finished work before partitions go; start every (re)assigned partition with a
    fresh watermark. A tracker kept across a rebalance could commit a stale offset: after the
    embedded broker restarts empty, offsets start at 0 again, and an old watermark would commit
    past records nobody has processed."""

    def __init__(self, runner: StageRunner, also: ConsumerRebalanceListener | None = None) -> None:
        self._runner = runner
        self._also = also  # a stage's own listener (prefill: partition ownership for routing)

    async def on_partitions_revoked(self, revoked) -> None:
        await self._runner._commit()
        for tp in revoked:
            self._runner._trackers.pop(tp, None)
        if self._also is not None:
            await self._also.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            self._runner._trackers.pop(tp, None)
        if self._also is not None:
            await self._also.on_partitions_assigned(assigned)


def restart_from_source(meta: protocol.RequestMeta, max_restarts: int, reason: str,
                        attempt: int | None = None) -> Outcome:
    """The request's entry message again with a fresh ``attempt`` (default ``attempt + 1``;
    the ledger's ``next_attempt`` where there is one), see the module contract."""
    if meta.attempt >= max_restarts:
        raise RequestFailed(503, f"request {meta.request_id} lost its intermediate tensors {meta.attempt + 1} "
                                 f"times ({reason}); giving up", type_="server_error", code="tensor_owner_lost")
    fresh = meta.attempt + 1 if attempt is None else attempt
    return Outcome([entry_message(msgspec.structs.replace(meta, attempt=fresh))])
