"""Where the Kafka ingress may answer (``ReplyTopics``), against a fake broker's topic list: a
whole match of the pattern, never a fleet topic, only a topic that exists, the topic list read
once for records that arrive together, and a topic created just before its request found."""

from __future__ import annotations

import asyncio

from services.gateway.ingress import ReplyTopics
from shared.settings import Settings


class _Cluster:
    def __init__(self, topics: set[str]) -> None:
        self._topics = topics

    def topics(self) -> set[str]:
        return set(self._topics)


class _Producer:
    def __init__(self, topics: set[str]) -> None:
        self.topics = topics
        self.reads = 0
        self.client = self

    async def fetch_all_metadata(self):
        self.reads += 1
        await asyncio.sleep(0.01)  # a round trip: concurrent callers overlap it
        return _Cluster(self.topics)


def replies(producer) -> ReplyTopics:
    return ReplyTopics(producer, Settings().ingress_reply_topic_pattern,
                       own=frozenset({"mm.decode", "mm.requests", "mm.replies.errors"}))


async def test_only_existing_topics_that_match_and_are_not_the_fleets_own():
    producer = _Producer({"mm.replies.a", "mm.decode", "mm.replies.errors", "elsewhere"})
    topics = replies(producer)
    assert await topics.refusal("mm.replies.a") is None
    for refused in ("mm.decode", "mm.requests", "mm.replies.errors", "elsewhere", "mm.replies.", "mm.replies.a/b",
                    "mm.replies.missing"):
        assert await topics.refusal(refused), refused


async def test_records_arriving_together_share_one_read_and_a_topic_created_before_its_request_is_found():
    producer = _Producer({"mm.replies.a"})
    topics = replies(producer)
    assert await asyncio.gather(*(topics.refusal("mm.replies.a") for _ in range(5))) == [None] * 5
    assert producer.reads == 1
    assert await topics.refusal("mm.replies.new")  # not there: refused after a read of its own
    assert producer.reads == 2
    producer.topics.add("mm.replies.new")  # created, then its request sent: a fresh read finds it
    assert await topics.refusal("mm.replies.new") is None and producer.reads == 3
    assert await asyncio.gather(*(topics.refusal(f"mm.replies.x{i}") for i in range(5)))  # unknown together
    assert producer.reads == 4  # one read for the five
