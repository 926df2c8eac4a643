"""Early start: a stage begins a record's work on the copy its doorbell ring carries, before
Kafka delivers it, and holds every effect others can see until Kafka does.

A run (:class:`EarlyRun`) works under the stage's ledger claim like a delivered record; its
outputs, releases, done-mark and error events wait for the record's delivery, its token-stream
writes for the record to be in Kafka (delivered or acked). Not delivered within ``confirm_ms``,
or its partition revoked, the run is dropped and nothing it did shows (caches it filled stay).

Design: docs/design/doorbell.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import msgspec

from shared import metrics, protocol
from shared.process.aio import succeeded
from shared.transport.delivery import Unconfirmed
from shared.transport.ledger import CLAIMED, StageLedger, WriteGuard

log = logging.getLogger(__name__)

_SEEN_MAX = 1024  # hashes of records delivered lately: a ring heard after its record starts nothing


class Unclaimed(Unconfirmed):
    """The run did not get the stage's claim (held elsewhere, done, aborted, or Redis away)."""


class EarlyRun:
    """One record started from its carried copy: a :class:`~shared.transport.delivery.Delivery`.

    Its claim's round trip overlaps the work (:meth:`claimed`): what it shows waits for the claim
    too. A claim held elsewhere, a done-mark or an abort drops the run with nothing shown
    (``handled`` False) and the record, when it comes, takes the usual path. Effects wait for the
    record (:meth:`confirmed`); stream writes for it to be in Kafka (:meth:`durable`), except a
    guarded append that Redis writes only if it shows the claim this run's and the record acked
    (``shared.transport.ledger.WriteGuard``); the log's compare-and-append keeps a write a later owner of the
    record repeats from showing twice. Dropped, the run releases its claim; tensor slots it put
    lapse with their leases."""

    def __init__(self, carried: protocol.CarriedRecord, msg, confirm_s: float) -> None:
        self.value = carried.value
        self.partition = carried.partition
        self.sent_unix_ms = carried.sent_unix_ms
        self.msg = msg
        self.handled = False  # set once the run holds the claim: the record's fate is the run's from then on
        self.dropped = False
        self.task: asyncio.Task | None = None
        self._record: asyncio.Future = asyncio.get_running_loop().create_future()
        self._in_kafka = asyncio.Event()  # the broker acked the record, or delivered it here
        self._claim: asyncio.Future | None = None
        self._guard: WriteGuard | None = None
        self._give_up = time.monotonic() + confirm_s

    def claim(self, enter: Awaitable[int], guard: WriteGuard | None = None) -> None:
        """Take the stage's claim (``enter``: the ledger's round trip) while the work starts:
        :meth:`confirmed`, which every effect awaits, waits for it too. ``guard``: what Redis shows
        once the claim is this run's and the record acked (for guarded stream writes)."""
        self._claim = asyncio.ensure_future(enter)
        self._claim.add_done_callback(self._claim_done)
        self._guard = guard

    async def enter(self, ledger: StageLedger, stage: str, meta: protocol.RequestMeta, worker_id: str,
                    topic: str) -> int:
        """The delivery's claim: taken while the work starts (:meth:`claim`), so ``CLAIMED`` at once;
        all the run shows waits for the round trip's answer."""
        self.claim(ledger.enter(meta.request_id, stage, meta.attempt, worker_id),
                   ledger.write_guard(meta.request_id, stage, meta.attempt, worker_id, topic, self.partition))
        return CLAIMED

    def write_guard(self) -> WriteGuard | None:
        """The guard for a stream write Redis may check instead of this run, while the run does not
        know yet that it may write (claim or ack not seen, nothing failed); None: write as usual."""
        if self._guard is None or self.dropped or (self._in_kafka.is_set() and self._claim.done()):
            return None
        return self._guard

    def _claim_done(self, fut: asyncio.Future) -> None:
        self.handled = _won(fut)

    async def claimed(self) -> None:
        """Returns once the run holds the claim; :class:`Unclaimed` (the run dropped) if it does not."""
        if self._claim is None:
            return
        try:
            state = await asyncio.shield(self._claim)
        except asyncio.CancelledError:
            if not self._claim.cancelled():  # this task's own cancellation
                raise
            state = None
        except Exception as exc:  # noqa: BLE001 - Redis away: the record, when it comes, takes the usual path
            self.drop()
            raise Unclaimed(f"the claim could not be taken ({exc!r})") from None
        if state != CLAIMED:
            self.drop()
            raise Unclaimed(f"the claim is not this run's (ledger state {state})")

    async def holds_claim(self) -> bool:
        """Whether the run got the claim, once its round trip is back (for the release)."""
        if self._claim is None:
            return True
        await asyncio.gather(self._claim, return_exceptions=True)
        return _won(self._claim)

    def adopt(self, tp, rec) -> bool:
        """Kafka delivered the record: wake whatever waits for it. False once the run was dropped."""
        if self.dropped or self._record.done():
            return False
        self._record.set_result((tp, rec))
        self._in_kafka.set()
        return True

    def acked(self) -> None:
        """The broker acked the record (its producer's second ring): it is in Kafka."""
        self._in_kafka.set()

    def drop(self) -> None:
        if not self._record.done():
            self.dropped = True
            self._record.cancel()
            self._in_kafka.set()  # wakes durable(), which sees the run dropped

    async def confirmed(self):
        """``(tp, rec)`` of the delivered record, the claim held; raises :class:`Unconfirmed` past
        the bound, :class:`Unclaimed` without the claim."""
        await self.claimed()
        if not self._record.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._record), max(self._give_up - time.monotonic(), 0.0))
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                if not self._record.cancelled():  # this task's own cancellation
                    raise
        if self._record.cancelled() or not self._record.done():
            self.drop()
            raise Unconfirmed(f"record not delivered by Kafka (partition {self.partition})")
        return self._record.result()

    async def durable(self) -> None:
        """Returns once the record is in Kafka (acked or delivered) and the run holds the claim;
        raises as :meth:`confirmed` does past the bound or without the claim."""
        await self.claimed()
        if not self._in_kafka.is_set():
            try:
                await asyncio.wait_for(self._in_kafka.wait(), max(self._give_up - time.monotonic(), 0.0))
            except TimeoutError:
                pass
        if self.dropped or not self._in_kafka.is_set():
            self.drop()
            raise Unconfirmed(f"record not in Kafka in time (partition {self.partition})")

    def writable(self) -> bool:
        """The record is in Kafka and the claim this run's, as far as the run has seen:
        :meth:`durable` would return at once."""
        return (not self.dropped and self._in_kafka.is_set()
                and (self._claim is None or (self._claim.done() and _won(self._claim))))

    def gate(self, events):
        """``events`` (an EventSink) whose writes wait for :meth:`durable`."""
        return _GatedEvents(events, self)


def _won(claim: asyncio.Future) -> bool:
    """A finished claim round trip that took the claim."""
    return succeeded(claim) and claim.result() == CLAIMED


class _GatedEvents:
    def __init__(self, inner, run: EarlyRun) -> None:
        self._inner = inner
        self._run = run

    async def append(self, request_id, event):
        await self._run.durable()
        return await self._inner.append(request_id, event)

    async def append_delta(self, request_id, delta, position):
        guard = self._run.write_guard()
        if guard is not None and hasattr(self._inner, "append_delta_if"):
            done = await self._inner.append_delta_if(request_id, delta, position, guard)
            if done is not None:  # Redis showed the claim ours and the record in Kafka
                return done
        await self._run.durable()
        return await self._inner.append_delta(request_id, delta, position)

    def append_delta_soon(self, request_id, delta, position):
        """The inner sink's, once the run may write (None before: await ``append_delta``)."""
        soon = getattr(self._inner, "append_delta_soon", None)
        return soon(request_id, delta, position) if soon is not None and self._run.writable() else None

    def __getattr__(self, name):  # reads (history, follow) need no record
        return getattr(self._inner, name)


class EarlyStarts:
    """A runner's early runs. ``start(run)`` does the work (the runner's record path);
    ``owns(partition)`` and ``free()`` come from its consume loop.

    :meth:`offer` starts a run only for a partition this consumer owns and is not pausing, within
    the runner's concurrency, and never for a record Kafka already delivered here or one already
    running. :meth:`adopt` hands the delivered record to its run: the record's offset is done when
    the run is."""

    def __init__(self, *, decoder: msgspec.msgpack.Decoder, start: Callable[[EarlyRun], Awaitable[None]],
                 owns: Callable[[int], bool], free: Callable[[], int], confirm_ms: int, stage: str = "") -> None:
        self._stage = stage
        self._decoder = decoder
        self._rings = protocol.decoder_for(protocol.RingPayload)
        self._start = start
        self._owns = owns
        self._free = free
        self._confirm_s = confirm_ms / 1000
        self._runs: dict[bytes, EarlyRun] = {}
        self._by_request: dict[tuple[str, int], EarlyRun] = {}  # (request id, attempt): for acked rings
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._delivered: dict[int, int] = {}  # partition -> the offset Kafka delivered here last
        self.started = 0  # for stats and tests
        self.adopted = 0

    def offer(self, payload: bytes) -> bool:
        """Take a ring's payload; False when the ring announces nothing to fetch (an acked record
        Kafka already delivered here): the doorbell then does not wake the consumer for it."""
        try:
            carried = self._rings.decode(payload)
            if isinstance(carried, protocol.AckedRecord):
                run = self._by_request.get((carried.request_id, carried.attempt))
                if run is not None and run.partition == carried.partition:
                    run.acked()
                return carried.offset > self._delivered.get(carried.partition, -1)
            if (carried.value in self._runs or hash(carried.value) in self._seen
                    or not self._owns(carried.partition) or self._free() - len(self._runs) <= 0):
                return True
            msg = self._decoder.decode(carried.value)
        except msgspec.DecodeError:
            return True  # not for this stage (or not decodable): the record's own delivery deals with it
        run = EarlyRun(carried, msg, self._confirm_s)
        self._runs[run.value] = run
        self._by_request[(msg.meta.request_id, msg.meta.attempt)] = run
        run.task = asyncio.create_task(self._run(run), name="early-start")
        self.started += 1
        metrics.EARLY_STARTS.labels(self._stage, "started").inc()
        return True

    async def _run(self, run: EarlyRun) -> None:
        try:
            await self._start(run)
        except Unconfirmed as exc:
            log.info("early start dropped: %s", exc)
            metrics.EARLY_STARTS.labels(self._stage, "dropped").inc()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the record's own delivery runs it again
            log.exception("early start failed")
        finally:
            if self._runs.get(run.value) is run:
                del self._runs[run.value]
            key = (run.msg.meta.request_id, run.msg.meta.attempt)
            if self._by_request.get(key) is run:
                del self._by_request[key]

    def adopt(self, tp, rec) -> EarlyRun | None:
        """The run started for this delivered record, now waiting on it; None: run it as usual."""
        self._seen[hash(rec.value)] = None
        # the latest, not the highest: a broker that lost its log (tansu in memory) starts offsets
        # again at 0, and a stale high mark would keep the acks of its new records from waking
        self._delivered[tp.partition] = rec.offset
        while len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        run = self._runs.get(rec.value)
        if run is None or run.partition != tp.partition or not run.adopt(tp, rec):
            return None
        self.adopted += 1
        metrics.EARLY_STARTS.labels(self._stage, "adopted").inc()
        return run

    def drop_partitions(self, partitions: set[int]) -> None:
        """Partitions revoked: their runs not yet adopted end (their records go to the new owner)."""
        for partition in partitions:
            self._delivered.pop(partition, None)
        self._drop([run for run in self._runs.values() if run.partition in partitions])

    async def close(self) -> None:
        """Stop: runs not adopted end, their claims released (adopted ones end with the consume loop)."""
        runs = list(self._runs.values())
        self._drop(runs)
        await asyncio.gather(*(run.task for run in runs if run.task is not None), return_exceptions=True)

    @staticmethod
    def _drop(runs: list[EarlyRun]) -> None:
        for run in runs:
            run.drop()
            if run.dropped and run.task is not None:
                run.task.cancel()  # its claim, if it took one, is released as the task unwinds
