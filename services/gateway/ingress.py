"""The Kafka way in: OpenAI request bodies on ``mm.requests``, answers on the caller's topic.

Record format (key = request_id, value = the HTTP body, headers ``reply_to``, ``authorization``,
``endpoint``) and reply format: docs/guide/kafka-ingress.md. A record is authenticated first:
one that fails is answered on the fixed errors topic only, and claims nothing. Replies go only to
an existing topic that matches ``ingress_reply_topic_pattern`` and is not the fleet's own; a
request_id is bounded and answered once per key (claimed in Redis under the key's identity).
Offsets are committed after the replies are acked. Design: docs/design/ingress.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import orjson
from aiokafka import TopicPartition
from prometheus_client import Counter

from services.gateway.frontend import Frontend
from services.gateway.responses import Rejected, Reply, error_reply
from services.stages import fleet_topics
from shared.keys import INGRESS_STAGE, TOPIC_REPLY_ERRORS, TOPIC_REQUESTS, consumer_group
from shared.transport.consume import ConsumeLoop
from shared.transport.ledger import CLAIMED, EpochWatch, StageLedger
from shared.transport.redis_conn import ride_out

log = logging.getLogger(__name__)

INGRESS_REQUESTS = Counter("mmfleet_ingress_requests_total", "Kafka ingress records by outcome", ["outcome"])
_RETRYABLE = ("overloaded", "queue_unavailable", "store_unavailable")
_CLAIM = 0  # StageLedger attempt number: an ingress claim is per request_id, never restarted
_TOPICS_REFRESH_S = 0.1  # the broker's topic list is read at most this often (unknown names wait for it)


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
        # fetching waits while ``ingress_concurrency`` requests are in flight: the backlog stays in Kafka
        self._loop = ConsumeLoop(s, TOPIC_REQUESTS, consumer_group(INGRESS_STAGE), name=INGRESS_STAGE,
                                 concurrency=s.ingress_concurrency, poll_timeout_ms=200, process=self._record,
                                 epoch=EpochWatch(claims.broker_epoch), doorbell=front.doorbell)
        self._fallback_topic = s.ingress_fallback_reply_topic or TOPIC_REPLY_ERRORS
        self._reply_topics = ReplyTopics(front.producer, s.ingress_reply_topic_pattern,
                                          own=frozenset(fleet_topics(s)))
        self._max_id_bytes = s.ingress_max_request_id_bytes

    def stop(self) -> None:
        self._loop.stop()

    async def run(self) -> None:
        """Consume, each record as its own task, commit as they finish; a bounded drain on stop."""
        await self._loop.run()

    async def _record(self, tp: TopicPartition, record) -> None:
        try:
            await self._one(record)
        except Exception as exc:  # e.g. reply_to could not be produced to: nobody to tell; the record is done
            INGRESS_REQUESTS.labels("failed").inc()
            log.error("ingress record %s@%d failed: %r", tp, record.offset, exc)

    # ------------------------------------------------------------------ one record
    async def _one(self, record) -> None:
        headers = _headers(record)
        request_id = (record.key or b"").decode("utf-8", "replace") or headers.get("request_id", "")
        too_long = len(request_id.encode()) > self._max_id_bytes
        if too_long:
            request_id = ""  # never echoed, never claimed: answered as invalid, below
        errors = _Answer(self._front.producer, self._fallback_topic, request_id)
        try:  # first: an unauthenticated record claims nothing and writes only to the errors topic
            key_id = self._front.auth.identify(headers.get("authorization"), via="kafka")
        except Rejected as rejected:
            INGRESS_REQUESTS.labels("unauthenticated").inc()
            await errors.reject(rejected)
            return
        reply_to = headers.get("reply_to", "")
        why = "the request has no reply_to header: nowhere to answer" if not reply_to else \
            await self._reply_topics.refusal(reply_to)
        if why:
            INGRESS_REQUESTS.labels("no_reply_to" if not reply_to else "bad_reply_to").inc()
            await errors.reject(Rejected.of(400, why, param="reply_to",
                                            code="missing_reply_to" if not reply_to else "invalid_reply_to"))
            return
        answer = _Answer(self._front.producer, reply_to, request_id)
        if not request_id:
            INGRESS_REQUESTS.labels("no_request_id").inc()
            await answer.reject(Rejected.of(
                400, f"the request_id is longer than {self._max_id_bytes} bytes" if too_long else
                "the request has no request_id: set the record key", param="request_id",
                code="invalid_request_id" if too_long else "missing_request_id"))
            return
        claim_id = request_id if key_id is None else f"{key_id}/{request_id}"  # ids are the key's own
        if not await self._claim(claim_id):
            INGRESS_REQUESTS.labels("duplicate").inc()
            log.info("ingress: request_id %r already answered or being answered; skipped", request_id)
            return
        keeper = self._claims.keeper(claim_id, INGRESS_STAGE, _CLAIM, self._owner)
        try:
            outcome = await self._serve(record.value or b"", headers, answer)
            await self._claims.mark_done(claim_id, INGRESS_STAGE, _CLAIM)
            INGRESS_REQUESTS.labels(outcome).inc()
        finally:
            await keeper.stop()
            await self._claims.release(claim_id, INGRESS_STAGE, _CLAIM, self._owner)

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
        give_up_ms = time.time() * 1000 + s.request_timeout_ms + 2 * s.stage_lease_ms
        # an unavailable Redis is waited out like a live holder: the record stays uncommitted meanwhile
        state = await ride_out(lambda: self._claims.enter_waiting(
            request_id, INGRESS_STAGE, _CLAIM, self._owner, check_abort=False, give_up_unix_ms=give_up_ms,
            poll_s=min(1.0, s.stage_lease_ms / 3000)), until_unix_ms=give_up_ms, what=f"ingress claim {request_id!r}")
        return state == CLAIMED


class ReplyTopics:
    """Which topics a Kafka request may be answered on: a whole match of ``pattern``, none of the
    fleet's own topics (``own``: every stage's, the infrastructure's and the errors topic), and one the broker
    already has: the ingress never creates a topic (producing to an unknown one could). A name not
    known yet is looked up in a read of the topic list made after it arrived (at most one read
    every ``_TOPICS_REFRESH_S``, shared by every name waiting), so a topic created just before
    its request was sent is found."""

    def __init__(self, producer, pattern: str, *, own: frozenset[str]) -> None:
        self._producer = producer
        self._pattern = re.compile(pattern)
        self._own = own
        self._known: set[str] = set()
        self._read_at = -_TOPICS_REFRESH_S
        self._reading = asyncio.Lock()  # records arriving together wait for one read of the topic list

    async def refusal(self, topic: str) -> str | None:
        """None when replies may go to ``topic``, else why not (for the error reply)."""
        if not self._pattern.fullmatch(topic) or topic in self._own:
            return (f"reply_to {topic[:80]!r} is not a topic this fleet answers on (it must match "
                    f"{self._pattern.pattern!r} and not be one of the fleet's own topics)")
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        async with self._reading:  # one read after a name's arrival answers it, and every name waiting with it
            if topic not in self._known and self._read_at < arrived:
                await asyncio.sleep(max(0.0, self._read_at + _TOPICS_REFRESH_S - loop.time()))
                self._read_at = loop.time()
                self._known = set((await self._producer.client.fetch_all_metadata()).topics())
        if topic not in self._known:
            return f"reply_to {topic!r} does not exist: create it before sending requests (replies never create topics)"
        return None


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
