"""The Kafka way in: OpenAI request bodies on ``mm.requests``, answers on the caller's topic.

Record format (key = request_id, value = the HTTP body, headers ``reply_to``, ``authorization``,
``endpoint``) and reply format: README "Requests over Kafka". Every refusal is answered; load
waits in Kafka; a request_id is answered once (claimed in Redis); offsets are committed after
the replies are acked. Each rule, and why: docs/ingress.md.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from prometheus_client import Counter

from services.gateway.frontend import Frontend
from services.gateway.responses import Rejected, Reply, error_reply
from shared.bus import OffsetTracker, make_consumer
from shared.keys import INGRESS_STAGE, TOPIC_REPLY_ERRORS, TOPIC_REQUESTS, consumer_group
from shared.ledger import StageLedger

log = logging.getLogger(__name__)

INGRESS_REQUESTS = Counter("mmfleet_ingress_requests_total", "Kafka ingress records by outcome", ["outcome"])
_RETRYABLE = ("overloaded", "queue_unavailable")
_CLAIM = 0  # StageLedger attempt number: an ingress claim is per request_id, never restarted


def _headers(record) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in record.headers or ():
        out[name.lower()] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")
    return out


class Ingress:
    """Consumes ``mm.requests`` in group ``mmfleet.ingress`` until :meth:`stop`."""

    def __init__(self, front: Frontend, claims: StageLedger, *, owner: str) -> None:
        self._front = front
        self._claims = claims
        self._owner = owner
        s = front.settings
        self._consumer = make_consumer(s, TOPIC_REQUESTS, consumer_group(INGRESS_STAGE))
        self._slots = asyncio.Semaphore(s.ingress_concurrency)
        self._trackers: dict[TopicPartition, OffsetTracker] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._fallback_topic = s.ingress_fallback_reply_topic or TOPIC_REPLY_ERRORS

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Fetch, run each record as a task (at most ``ingress_concurrency``), commit as they
        finish. When full, fetching waits for a slot: the backlog stays in Kafka."""
        await self._consumer.start()
        try:
            while not self._stopping.is_set():
                batches = await self._consumer.getmany(timeout_ms=200,
                                                       max_records=self._front.settings.max_poll_records)
                for tp, records in batches.items():
                    tracker = self._trackers.setdefault(tp, OffsetTracker())
                    for record in records:
                        await self._slots.acquire()
                        tracker.begin(record.offset)
                        task = asyncio.create_task(self._one(record))
                        self._tasks.add(task)
                        task.add_done_callback(lambda t, tp=tp, off=record.offset: self._finished(t, tp, off))
                await self._commit()
        finally:
            if self._tasks:  # a bounded drain: what does not finish is redelivered
                await asyncio.wait(self._tasks, timeout=self._front.settings.drain_timeout_ms / 1000)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._commit()
            await self._consumer.stop()

    def _finished(self, task: asyncio.Task, tp: TopicPartition, offset: int) -> None:
        self._tasks.discard(task)
        self._slots.release()
        if task.cancelled():
            return  # not done: left uncommitted, so it is redelivered
        if task.exception() is not None:  # e.g. reply_to could not be produced to: nobody to tell
            INGRESS_REQUESTS.labels("failed").inc()
            log.error("ingress record %s@%d failed: %r", tp, offset, task.exception())
        self._trackers[tp].done(offset)

    async def _commit(self) -> None:
        offsets = {tp: off for tp, t in self._trackers.items() if (off := t.committable()) is not None}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:  # rebalance: the records come back, claims de-duplicate
            log.warning("ingress commit failed (%r); the records will be redelivered", exc)
            return
        for tp, off in offsets.items():
            self._trackers[tp].mark_committed(off)

    # ------------------------------------------------------------------ one record
    async def _one(self, record) -> None:
        headers = _headers(record)
        request_id = (record.key or b"").decode("utf-8", "replace") or headers.get("request_id", "")
        reply_to = headers.get("reply_to", "")
        answer = _Answer(self._front.producer, reply_to or self._fallback_topic,
                         request_id)
        if not reply_to:
            INGRESS_REQUESTS.labels("no_reply_to").inc()
            await answer.reject(Rejected.of(400, "the request has no reply_to header: nowhere to answer",
                                            param="reply_to", code="missing_reply_to"))
            return
        if not request_id:
            INGRESS_REQUESTS.labels("no_request_id").inc()
            await answer.reject(Rejected.of(400, "the request has no request_id: set the record key",
                                            param="request_id", code="missing_request_id"))
            return
        if not await self._claim(request_id):
            INGRESS_REQUESTS.labels("duplicate").inc()
            log.info("ingress: request_id %r already answered or being answered; skipped", request_id)
            return
        refresher = asyncio.create_task(self._keep_claim(request_id))
        try:
            outcome = await self._serve(record.value or b"", headers, answer)
            await self._claims.mark_done(request_id, INGRESS_STAGE, _CLAIM)
            INGRESS_REQUESTS.labels(outcome).inc()
        finally:
            refresher.cancel()
            await self._claims.release(request_id, INGRESS_STAGE, _CLAIM, self._owner)

    async def _serve(self, body: bytes, headers: dict[str, str], answer: _Answer) -> str:
        front = self._front
        chat = headers.get("endpoint", "chat.completions").strip("/").removeprefix("v1/") != "completions"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + front.settings.request_timeout_ms / 1000
        while True:
            try:
                async with front.admit(body, chat=chat, authorization=headers.get("authorization"),
                                       via="kafka") as adm:
                    async for reply in front.replies(adm):
                        await answer.send(reply)
                    await answer.flush()
                    return "answered"
            except Rejected as rejected:
                retry_s = rejected.retry_after_s
                if rejected.event.code in _RETRYABLE and retry_s and loop.time() + retry_s < deadline:
                    await asyncio.sleep(retry_s)
                    continue
                await answer.reject(rejected)
                return "rejected"

    async def _claim(self, request_id: str) -> bool:
        """True once this process holds the request_id's claim; False when it is answered, or
        still being answered by a live holder past the request's deadline."""
        s = self._front.settings
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (s.request_timeout_ms + 2 * s.stage_lease_ms) / 1000
        while True:
            if await self._claims.is_done(request_id, INGRESS_STAGE, _CLAIM):
                return False
            if await self._claims.claim(request_id, INGRESS_STAGE, _CLAIM, self._owner):
                return True
            if loop.time() > give_up:
                return False
            await asyncio.sleep(min(1.0, s.stage_lease_ms / 3000))  # a holder that died lapses within a lease

    async def _keep_claim(self, request_id: str) -> None:
        while True:
            await asyncio.sleep(self._claims.lease_ms / 3000)
            await self._claims.refresh(request_id, INGRESS_STAGE, _CLAIM, self._owner)


class _Answer:
    """The replies of one request to one topic, in order: each record is queued on the
    producer at once (per-partition order is the producer's), acknowledged all together."""

    def __init__(self, producer, topic: str, request_id: str) -> None:
        self._producer = producer
        self._topic = topic
        self._key = request_id.encode() if request_id else None
        self._request_id = request_id
        self._seq = 0
        self._pending: list[asyncio.Future] = []

    async def send(self, reply: Reply) -> None:
        headers = [("request_id", self._request_id.encode()), ("mmfleet-kind", reply.kind.encode()),
                   ("mmfleet-status", str(reply.status).encode()), ("mmfleet-seq", str(self._seq).encode()),
                   ("mmfleet-last", b"1" if reply.last else b"0")]
        self._seq += 1
        self._pending.append(await self._producer.send(self._topic, orjson.dumps(reply.body), key=self._key,
                                                       headers=headers))

    async def flush(self) -> None:
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)

    async def reject(self, rejected: Rejected) -> None:
        await self.send(error_reply(rejected.event))
        await self.flush()
