"""Kafka plumbing: client construction, topic creation, and producing (routed, retried).

Everything that knows aiokafka's constructor arguments lives here so stages, the gateway, the
ingress and ``mmfleet submit`` share one configuration, TLS and SASL included
(:func:`kafka_client_kwargs`).

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
)
from aiokafka.helpers import create_ssl_context

from shared import protocol
from shared.settings import Settings
from shared.stage import Produce

log = logging.getLogger(__name__)


_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def kafka_client_kwargs(settings: Settings) -> dict:
    """Connection arguments every aiokafka client gets: bootstrap, TLS and SASL.

    Raises ``ValueError`` for an unknown protocol or mechanism, or SASL without a username;
    the message names the setting, never a secret's value.
    """
    proto = settings.kafka_security_protocol.upper()
    if proto not in _PROTOCOLS:
        raise ValueError(f"MMFLEET_KAFKA_SECURITY_PROTOCOL must be one of {', '.join(_PROTOCOLS)}")
    kw: dict = {"bootstrap_servers": settings.kafka_bootstrap, "security_protocol": proto}
    if proto in ("SSL", "SASL_SSL"):
        ctx = create_ssl_context(cafile=settings.kafka_ssl_cafile or None,
                                 certfile=settings.kafka_ssl_certfile or None,
                                 keyfile=settings.kafka_ssl_keyfile or None)
        ctx.check_hostname = settings.kafka_ssl_check_hostname
        kw["ssl_context"] = ctx
    if proto.startswith("SASL_"):
        mech = settings.kafka_sasl_mechanism.upper()
        if mech not in _MECHANISMS:
            raise ValueError(f"MMFLEET_KAFKA_SASL_MECHANISM must be one of {', '.join(_MECHANISMS)} with {proto}")
        if not settings.kafka_sasl_username:
            raise ValueError(f"MMFLEET_KAFKA_SASL_USERNAME is required with {proto}")
        kw.update(sasl_mechanism=mech, sasl_plain_username=settings.kafka_sasl_username,
                  sasl_plain_password=settings.kafka_sasl_password)
    return kw


def make_producer(settings: Settings) -> AIOKafkaProducer:
    # acks=all: an output counts as produced only once the broker has it; linger 0 because
    # every record is on a request's critical path.
    return AIOKafkaProducer(
        **kafka_client_kwargs(settings),
        acks="all",
        linger_ms=0,
        request_timeout_ms=30_000,
        max_request_size=1024 * 1024,
    )


def make_consumer(settings: Settings, topic: str, group_id: str,
                  listener: ConsumerRebalanceListener | None = None, *,
                  fetch_max_wait_ms: int | None = None) -> AIOKafkaConsumer:
    """``fetch_max_wait_ms``: the broker-side wait (default the setting); 1 for a consumer a
    :class:`shared.transport.doorbell.Doorbell` is attached to, which waits client-side instead (tansu
    answers a fetch with max wait 0 with no records at all, so 1 ms is the least that works)."""
    consumer = AIOKafkaConsumer(
        **kafka_client_kwargs(settings),
        group_id=group_id,
        enable_auto_commit=False,  # the runner commits only after outputs are acknowledged
        auto_offset_reset="earliest",
        fetch_max_wait_ms=settings.fetch_max_wait_ms if fetch_max_wait_ms is None else fetch_max_wait_ms,
        max_poll_records=settings.max_poll_records,
        # getmany() keeps being called while partitions are paused, so long handlers never
        # exceed the poll interval; the bound is for a wedged event loop.
        max_poll_interval_ms=300_000,
        session_timeout_ms=settings.kafka_session_timeout_ms,
        heartbeat_interval_ms=max(100, settings.kafka_session_timeout_ms // 3),
    )
    consumer.subscribe([topic], listener=listener)
    return consumer


async def ensure_topics(settings: Settings, topics: tuple[str, ...], *, timeout_s: float = 30.0) -> None:
    """Create missing topics with ``settings.topic_partitions`` partitions (idempotent);
    retries until the broker answers or ``timeout_s`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings), request_timeout_ms=5_000)
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            missing = [t for t in topics if t not in existing]
            if missing:
                replicas = settings.topic_replication_factor
                try:
                    await admin.create_topics([NewTopic(t, num_partitions=settings.topic_partitions,
                                                        replication_factor=replicas) for t in missing])
                except TopicAlreadyExistsError:
                    pass  # another process raced us: fine
                log.info("created topics %s (%d replicas)", missing, replicas)
            return
        except (KafkaConnectionError, OSError) as exc:
            if loop.time() > deadline:
                raise RuntimeError(f"Kafka at {settings.kafka_bootstrap} not reachable: {exc}") from exc
            await asyncio.sleep(0.3)
        finally:
            await admin.close()


TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)  # the request's size, not the broker's state


async def send_retrying(producer: AIOKafkaProducer, topic: str, value: bytes, key: bytes, *,
                        deadline_unix_ms: int, first_try=None, partition: int | None = None) -> None:
    """Produce one record and wait for the broker's ack, retrying broker errors (a broker that
    is restarting refuses connections, and one that came back empty answers "unknown topic"
    or an unknown error until the topics are created again) with backoff until
    ``deadline_unix_ms``; then the last error is raised. Each wait ends at the deadline too
    (``KafkaTimeoutError``): a broker that stalls without an answer holds a request no longer than
    one that refuses it (aiokafka's own bound is its ``request_timeout_ms``). A record too large for
    the broker is raised at once (:data:`TOO_LARGE`): no retry makes it fit. ``first_try``: an
    already-sent record's future to wait on before retrying. Returns the broker's ``RecordMetadata``."""
    delay_s = 0.1
    while True:
        try:
            fut, first_try = first_try, None
            try:  # a timer, not a task, per record: this is every stage output's path
                async with asyncio.timeout(max(deadline_unix_ms / 1000 - time.time(), 0.001)):
                    if fut is None:
                        fut = await producer.send(topic, value, key=key, partition=partition)
                    return await asyncio.shield(fut)  # a wait given up on leaves the record with the producer
            except TimeoutError:
                raise KafkaTimeoutError("no answer from the broker before the deadline") from None
        except KafkaError as exc:
            left_s = deadline_unix_ms / 1000 - time.time()
            if left_s <= delay_s or isinstance(exc, TOO_LARGE):
                raise
            log.warning("produce to %s failed (%r); retrying in %.1f s", topic, exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)


async def routed(router, p: Produce) -> tuple[int | None, object]:
    """The partition ``p`` goes to and the value to send: its own partition, else the router's
    pick (and the value carrying the decision) when ``router`` (a
    :class:`shared.kv.router.Router`) routes ``p.topic``, else None (by key)."""
    if p.partition is None and router is not None and p.topic == router.topic:
        return await router.route(p.value)
    return p.partition, p.value


# A ring carries a copy of a stage record up to this size (a prompt of ~10k tokens); a bigger
# record rings bare and its stage starts when Kafka delivers it.
CARRY_MAX_BYTES = 64 * 1024


def _carried(producer: AIOKafkaProducer, topic: str, partition: int | None, key: bytes, value: bytes,
             sent_unix_ms: int) -> bytes:
    """The ring payload for a record just queued (``protocol.CarriedRecord``), or b"" when it is
    too big or its partition is not known yet (the producer's own choice for a keyed record)."""
    if len(value) > CARRY_MAX_BYTES:
        return b""
    if partition is None:
        try:  # aiokafka 0.14: the partitioner call send() just made, with the metadata it loaded
            partition = producer._partition(topic, None, None, None, key, value)
        except Exception:  # noqa: BLE001 - no metadata: the ring goes bare
            return b""
    return protocol.encode(protocol.CarriedRecord(partition=partition, sent_unix_ms=sent_unix_ms, value=value))


async def produce_all(producer: AIOKafkaProducer, produces: list[Produce], *, deadline_unix_ms: int, router=None,
                      doorbell=None, carry: bool = False) -> None:
    """Send every record at once (to the partition :func:`routed` picks) and wait for
    every broker ack (:func:`send_retrying` until ``deadline_unix_ms``). ``doorbell`` is rung
    for each record as it goes out, the ring carrying a copy of a stage record (one with a
    ``meta``) when ``carry``; and again, bare, when an ack came late or a record was not even
    queued at first; a carried record's ack rings too, with a ``protocol.AckedRecord`` (see
    :mod:`shared.transport.doorbell`, :mod:`shared.transport.early`)."""
    sent_at, sent_unix_ms = time.monotonic(), int(time.time() * 1000)
    sends, rings = [], {}
    for p in produces:
        partition, value = await routed(router, p)
        meta = getattr(value, "meta", None)  # a stage record's
        value, key = protocol.encode(value), p.key.encode()
        try:
            fut = await producer.send(p.topic, value, key=key, partition=partition)
        except KafkaError:
            fut = None  # not even queued (e.g. no metadata for the topic yet): retried below
        payload = b""
        if fut is not None and doorbell is not None:
            payload = _carried(producer, p.topic, partition, key, value, sent_unix_ms) \
                if carry and meta is not None else b""
            rings.setdefault(p.topic, []).append(payload)
        sends.append((p.topic, value, key, partition, fut, meta if payload else None))
    for topic, payloads in rings.items():  # on their way: the next stage fetches while the broker acks
        for payload in [x for x in payloads if x] or [b""]:  # one ring per topic unless records ride on it
            doorbell.ring(topic, payload)
    acked = []
    for topic, value, key, partition, fut, carried_meta in sends:
        md = await send_retrying(producer, topic, value, key, deadline_unix_ms=deadline_unix_ms, first_try=fut,
                                 partition=partition)
        if carried_meta is not None and md is not None:
            acked.append((topic, protocol.AckedRecord(partition=md.partition, offset=md.offset,
                                                      request_id=carried_meta.request_id,
                                                      attempt=carried_meta.attempt)))
    for topic, record in acked:  # in Kafka now: an early run of it may show its stream writes
        doorbell.ring_acked(topic, record)
    if doorbell is not None and (doorbell.late(sent_at) or any(fut is None for *_, fut, _ in sends)):
        for topic in {topic for topic, *_ in sends} - {topic for topic, _ in acked}:  # wake again: no longer expected
            doorbell.ring(topic)


async def produce_entry(producer: AIOKafkaProducer, entry: Produce, *, deadline_unix_ms: int, router=None,
                        doorbell=None, carry: bool = False) -> None:
    """Produce a request's entry message (``shared.stage.entry_message``: from the gateway, or
    again after a broker restart) routed like every other record: :func:`produce_all`."""
    await produce_all(producer, [entry], deadline_unix_ms=deadline_unix_ms, router=router, doorbell=doorbell,
                      carry=carry)
