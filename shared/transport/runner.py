"""The one generic stage runner: consume → handle → produce → release → commit.

Every stage gets the same semantics: at-least-once (commit after the outputs are acked), bounded
(``concurrency`` in flight, partitions paused beyond), deadlines (504 without work), idempotent
under a ``StageLedger`` claim, restarts from the source on a lost tensor owner, retries then
dead-letter on faults, a bounded drain on ``stop()``, and (with a doorbell) client-side idle
waits that an upstream produce cuts short and early starts on the record a ring carries. A Redis
that stalls or goes away is no fault of the record: it is handled again, with backoff, until
Redis answers (the record uncommitted meanwhile) or its deadline passes.

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time

import msgspec
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from shared import logs, metrics, protocol, tracing
from shared.keys import TOPIC_DEAD_LETTER, consumer_group
from shared.settings import Settings
from shared.stage import Context, Handler, Outcome, Produce, RequestFailed, entry_message
from shared.transfer import OwnerGoneError
from shared.transport.bus import TOO_LARGE, produce_all
from shared.transport.consume import ConsumeLoop
from shared.transport.delivery import Delivered, Delivery, Unconfirmed
from shared.transport.early import EarlyRun, EarlyStarts
from shared.transport.ledger import ABORTED, DONE, EpochWatch
from shared.transport.redis_conn import ride_out, unavailable

log = logging.getLogger(__name__)


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
        self._router = router  # shared.kv.router.Router: picks the partitions of the topic it routes
        self._doorbell = doorbell  # shared.transport.doorbell.Doorbell: rung after produces, wakes this consumer
        self._loop = ConsumeLoop(settings, topic, consumer_group(stage), name=stage,
                                 concurrency=concurrency or settings.stage_concurrency,
                                 poll_timeout_ms=settings.fetch_max_wait_ms + 100, process=self._handle_record,
                                 listener=rebalance_listener, doorbell=doorbell, lag_label=stage,
                                 epoch=EpochWatch(ctx.ledger.broker_epoch) if ctx.ledger is not None else None)
        self.assigned = self._loop.assigned  # set once the group gave this runner partitions
        self.early: EarlyStarts | None = None
        self._deliveries = itertools.count()  # numbers each delivered record's claim token
        if doorbell is not None and settings.early_start and ctx.ledger is not None:  # the claim makes it safe
            self.early = EarlyStarts(decoder=self._decoder, start=self._early_run, owns=self._loop.owns,
                                     free=self._loop.free, confirm_ms=settings.early_start_confirm_ms,
                                     stage=stage)
            doorbell.on_carried(topic, self.early.offer)
            self._loop.on_revoked = self.early.drop_partitions

    @property
    def processed(self) -> int:
        """Records finished (any outcome), for stats and tests."""
        return self._loop.processed

    async def run(self) -> None:
        """Consume until ``stop()``; then drain and close. Raises on a fatal consumer error."""
        try:
            await self._loop.run()
        finally:
            if self.early is not None:
                await self.early.close()

    def stop(self) -> None:
        self._loop.stop()

    # ------------------------------------------------------------------ one record
    async def _handle_record(self, tp: TopicPartition, rec) -> None:
        run = self.early.adopt(tp, rec) if self.early is not None else None
        if run is not None:
            await run.task
            if run.handled:
                return
        try:
            msg = self._decoder.decode(rec.value)
        except msgspec.DecodeError as exc:
            # Undecodable: no request id to answer to; keep it for an operator.
            with logs.bind(stage=self.stage):
                log.warning("undecodable record at %s:%d: %s", tp.partition, rec.offset, exc)
            await self._dead_letter(tp, rec, f"undecodable record: {exc}", attempts=1)
            self._count("dead_letter")
            return
        meta: protocol.RequestMeta = msg.meta
        delivery = Delivered(tp, rec)
        # this delivery's own claim token: a try cut short by Redis may leave its claim behind (an
        # enter whose reply timed out still runs once Redis resumes), released before the next try
        owner, tries = f"{self._ctx.worker_id}/{next(self._deliveries)}", itertools.count()

        async def handle() -> None:
            if next(tries) and self._ctx.ledger is not None:
                await self._ctx.ledger.release(meta.request_id, self.stage, meta.attempt, owner)
            await self._handle_decoded(delivery, msg, owner)

        with logs.bind(request_id=meta.request_id, stage=self.stage):
            try:
                await ride_out(handle, until_unix_ms=meta.deadline_unix_ms, what=f"{self.stage}: {meta.request_id}")
            except Exception as exc:
                if not unavailable(exc):
                    raise
                # past its deadline nothing can be written for it (not even the 504): its reader gives up
                log.error("%s: Redis still unavailable past the deadline of %s (%r); the record is dropped",
                          self.stage, meta.request_id, exc)
                self._count("redis_unavailable")

    def _count(self, outcome: str) -> None:
        metrics.STAGE_RECORDS.labels(self.stage, outcome).inc()

    async def _early_run(self, run: EarlyRun) -> None:
        with logs.bind(request_id=run.msg.meta.request_id, stage=self.stage):
            try:
                await self._handle_decoded(run, run.msg, self._ctx.worker_id)
            except Exception as exc:
                if not unavailable(exc):
                    raise
                log.warning("%s: early start of %s met an unavailable Redis (%r); the record's own delivery "
                            "handles it", self.stage, run.msg.meta.request_id, exc)
                run.drop()
                run.handled = False  # it did not: the delivered record is handled (and rides the outage out)

    async def _handle_decoded(self, delivery: Delivery, msg, owner: str) -> None:
        """``owner``: the claim's token (this worker's id for an early run, whose stream writes Redis
        checks against it)."""
        meta: protocol.RequestMeta = msg.meta
        queue_ms = now_ms() - delivery.sent_unix_ms  # produced → picked up here
        ledger = self._ctx.ledger
        if ledger is None:
            await self._attempts(delivery, msg, queue_ms)
            return
        t_claim = time.perf_counter()
        state = await delivery.enter(ledger, self.stage, meta, owner, self.topic)
        if state == ABORTED:
            await self._fail(delivery, meta, RequestFailed(499, "the client closed the request",
                                                           type_="invalid_request_error",
                                                           code="client_closed_request"), outcome="aborted")
            return
        if state == DONE:
            log.debug("%s: %s is done already; skipping the redelivery", self.stage, meta.request_id)
            self._count("duplicate")
            return  # done already (or by the live worker that held the claim)
        claim_ms = (time.perf_counter() - t_claim) * 1000  # Redis round trips before the work
        keeper = ledger.keeper(meta.request_id, self.stage, meta.attempt, owner)
        finished = False
        try:
            await self._attempts(delivery, msg, queue_ms, claim_ms)
            await delivery.confirmed()  # never a done-mark without the claim (every effect waited for it)
            await keeper.stop()
            # the outputs are in Kafka: only the done-mark waits for Redis, not the work again
            await ride_out(lambda: ledger.finish(meta.request_id, self.stage, meta.attempt, owner),
                           until_unix_ms=meta.deadline_unix_ms, what=f"{self.stage}: done-mark of {meta.request_id}")
            finished = True
        finally:
            await keeper.stop()
            if not finished and await delivery.holds_claim():
                try:
                    await ledger.release(meta.request_id, self.stage, meta.attempt, owner)
                except Exception as exc:
                    if not unavailable(exc):
                        raise
                    # the error on its way out says why; the next try releases it first, else it lapses
                    log.debug("%s: claim of %s not released: %r", self.stage, meta.request_id, exc)

    async def _attempts(self, delivery: Delivery, msg, queue_ms: float, claim_ms: float = 0.0) -> None:
        """Nothing leaves this worker before ``delivery.confirmed()``; stream writes are gated."""
        meta: protocol.RequestMeta = msg.meta
        attempts = 0
        while True:
            attempts += 1
            if now_ms() > meta.deadline_unix_ms:
                await self._fail(delivery, meta, RequestFailed.deadline(meta.request_id, self.stage))
                return
            try:
                outcome = await self._run_stage(self._handler, msg, self._ctx, queue_ms, claim_ms, delivery)
            except RequestFailed as failed:
                await self._fail(delivery, meta, failed)
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
                    await self._fail(delivery, meta, failed)
                    return
            except (asyncio.CancelledError, Unconfirmed):  # an early start's record did not come: drop it
                raise
            except Exception as exc:
                if unavailable(exc):  # Redis, not the record: no attempt spent (the record is handled again)
                    raise
                await delivery.claimed()  # an early start without the claim drops here rather than retry
                log.exception("%s: handler failed for %s (attempt %d)", self.stage, meta.request_id, attempts)
                if attempts >= self._settings.max_attempts:
                    tp, rec = await delivery.confirmed()
                    await self._dead_letter(tp, rec, f"{type(exc).__name__}: {exc}", attempts)
                    await self._fail(delivery, meta, RequestFailed(
                        500, f"stage {self.stage} failed {attempts} times on this request; it was "
                             f"moved to {TOPIC_DEAD_LETTER}", type_="server_error", code="stage_failed"),
                        outcome="dead_letter")
                    return
                await asyncio.sleep(min(0.05 * 2 ** attempts, 2.0))
                continue
            await delivery.confirmed()
            try:
                await self._deliver(outcome, meta.deadline_unix_ms)
            except TOO_LARGE:  # an output no retry makes fit: the request's size, answered as such
                await self._fail(delivery, meta, RequestFailed(
                    413, f"stage {self.stage}'s output for this request is too large to queue",
                    code="request_too_large"))
                return
            except KafkaError as exc:  # the broker stayed unreachable until the deadline
                await self._fail(delivery, meta, RequestFailed(
                    503, f"stage {self.stage} could not queue its output before the deadline "
                         f"({type(exc).__name__})", type_="server_error", code="queue_unavailable"))
                return
            self._count("ok")
            log.debug("%s: handled %s (%d outputs)", self.stage, meta.request_id, len(outcome.produce))
            return

    async def _run_stage(self, handler: Handler, msg, ctx: Context, queue_ms: float, claim_ms: float,
                         delivery: Delivery) -> Outcome:
        """One handler call under its stage span, its stream writes gated by ``delivery``; its
        outputs carry the span; outputs for local stages are handled here too (queue 0), and only
        the rest goes to Kafka."""
        events = delivery.gate(ctx.events)
        if events is not ctx.events:  # an early start's: the context's other parts stay shared
            ctx = dataclasses.replace(ctx, events=events)
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
            sub = await self._run_stage(route[0], value, route[1], 0.0, 0.0, delivery)
            # a stage handed its message in memory finished one too (its failures end the
            # whole chain and count under the stage that consumed the record)
            metrics.STAGE_RECORDS.labels(route[1].stage, "ok").inc()
            produce.extend(sub.produce)
            releases.extend(sub.releases)
        return Outcome(produce, releases)

    async def _deliver(self, outcome: Outcome, deadline_unix_ms: int) -> None:
        """Produce the outputs (all sent at once; mm.prefill records to the partition the router
        picks), wait for every broker ack (the output is durable before anything upstream is
        freed), retrying broker errors until the deadline."""
        await produce_all(self._producer, outcome.produce, deadline_unix_ms=deadline_unix_ms, router=self._router,
                          doorbell=self._doorbell, carry=self._settings.early_start)
        if self._ctx.transfer is not None:
            for owner, leases in outcome.releases:
                await self._ctx.transfer.release(owner, leases)

    async def _fail(self, delivery: Delivery, meta: protocol.RequestMeta, failed: RequestFailed,
                    outcome: str | None = None) -> None:
        """Write the request's terminal error once the delivery is confirmed; count ``outcome``
        (default: deadline for a 504, else failed)."""
        await delivery.confirmed()
        log.info("%s: request %s failed: %s", self.stage, meta.request_id, failed.event.message)
        await ride_out(lambda: self._ctx.events.append(meta.request_id, failed.event),
                       until_unix_ms=meta.deadline_unix_ms, what=f"{self.stage}: terminal error of {meta.request_id}")
        self._count(outcome or ("deadline" if failed.event.status == 504 else "failed"))

    async def _dead_letter(self, tp: TopicPartition, rec, error: str, attempts: int) -> None:
        letter = protocol.DeadLetter(topic=tp.topic, partition=tp.partition, offset=rec.offset,
                                     error=error[:4000], attempts=attempts, value=rec.value)
        await self._producer.send_and_wait(TOPIC_DEAD_LETTER, protocol.encode(letter), key=rec.key)


def restart_from_source(meta: protocol.RequestMeta, max_restarts: int, reason: str,
                        attempt: int | None = None) -> Outcome:
    """The request's entry message again with a fresh ``attempt`` (default ``attempt + 1``;
    the ledger's ``next_attempt`` where there is one), see the module contract."""
    if meta.attempt >= max_restarts:
        raise RequestFailed(503, f"request {meta.request_id} lost its intermediate tensors {meta.attempt + 1} "
                                 f"times ({reason}); giving up", type_="server_error", code="tensor_owner_lost")
    fresh = meta.attempt + 1 if attempt is None else attempt
    return Outcome([entry_message(msgspec.structs.replace(meta, attempt=fresh))])
