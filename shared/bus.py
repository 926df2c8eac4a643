"""Kafka plumbing: client construction, topic creation, and commit bookkeeping.

Everything that knows aiokafka's constructor arguments lives here so stages and the gateway
share one configuration (and later one place for TLS/SASL).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from shared.keys import ALL_TOPICS
from shared.settings import Settings

log = logging.getLogger(__name__)


def make_producer(settings: Settings) -> AIOKafkaProducer:
    # acks=all: an output counts as produced only once the broker has it; linger 0 because
    # every record is on a request's critical path.
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        acks="all",
        linger_ms=0,
        request_timeout_ms=30_000,
        max_request_size=1024 * 1024,
    )


def make_consumer(settings: Settings, topic: str, group_id: str, listener=None) -> AIOKafkaConsumer:
    """``listener``: an aiokafka ``ConsumerRebalanceListener`` told of every rebalance."""
    consumer = AIOKafkaConsumer(
        *(() if listener is not None else (topic,)),
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=group_id,
        enable_auto_commit=False,  # the runner commits only after outputs are acknowledged
        auto_offset_reset="earliest",
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        max_poll_records=settings.max_poll_records,
        # getmany() keeps being called while partitions are paused, so long handlers never
        # exceed the poll interval; the bound is for a wedged event loop.
        max_poll_interval_ms=300_000,
        session_timeout_ms=10_000,
        heartbeat_interval_ms=3_000,
    )
    if listener is not None:
        consumer.subscribe([topic], listener=listener)
    return consumer


async def ensure_topics(settings: Settings, topics: tuple[str, ...] = ALL_TOPICS, *, timeout_s: float = 30.0) -> None:
    """Create missing topics with ``settings.topic_partitions`` partitions (idempotent);
    retries until the broker answers or ``timeout_s`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, request_timeout_ms=5_000)
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            missing = [t for t in topics if t not in existing]
            if missing:
                try:
                    await admin.create_topics(
                        [NewTopic(t, num_partitions=settings.topic_partitions, replication_factor=1) for t in missing]
                    )
                except TopicAlreadyExistsError:
                    pass  # another process raced us: fine
                log.info("created topics %s", missing)
            return
        except (KafkaConnectionError, OSError) as exc:
            if loop.time() > deadline:
                raise RuntimeError(f"Kafka at {settings.kafka_bootstrap} not reachable: {exc}") from exc
            await asyncio.sleep(0.3)
        finally:
            await admin.close()


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
