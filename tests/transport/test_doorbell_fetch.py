"""The doorbell's fetch wrapper (shared/transport/doorbell.py, ``Doorbell.attach``) driven by a scripted
broker in place of aiokafka's one-fetch method, with the assignment and fetch request aiokafka
passes it: what follows an empty answer (a fetch at once inside the window after a ring, a repeat
while the broker reports records past our position, else a sleep until a ring). Real Redis
carries the rings; no Kafka broker is needed."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from shared.transport.doorbell import _BEHIND_REPEATS, Doorbell
from tests.waits import until

TOPIC = "t.bell.scripted"


@pytest.fixture
async def redis(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


def _assignment(highwater: int, position: int):
    """What aiokafka's fetcher passes: partition states by TopicPartition (0.14's SubscriptionState)."""
    state = SimpleNamespace(has_valid_position=True, highwater=highwater, position=position)
    return state, SimpleNamespace(state_value=lambda tp: state)


def _request(topic: str = TOPIC):
    """A FetchRequest's ``topics``: (topic, [(partition, offset, log_start, max_bytes)])."""
    return SimpleNamespace(topics=[(topic, [(0, 1, -1, 1 << 20)])])


def _consumer(fetch):
    return SimpleNamespace(_fetcher=SimpleNamespace(_proc_fetch_request=fetch))


def _answering(redis, *, expect_ms: float):
    """A doorbell attached to a fetch that returns the scripted ``answers`` in turn: (doorbell,
    the wrapped fetch to call as aiokafka would, the answers list to fill)."""
    sub = Doorbell(redis, f"t{uuid.uuid4().hex[:8]}", idle_fetch_interval_ms=60_000, expect_ms=expect_ms)
    answers: list[bool] = []

    async def fetch(_assignment, _node_id, _request) -> bool:
        return answers.pop(0)

    consumer = _consumer(fetch)
    sub.attach(consumer, TOPIC)
    return sub, consumer._fetcher._proc_fetch_request, answers


async def _still_waiting(fetch, after_s: float = 0.3) -> bool:
    """Whether the wrapped ``fetch`` (a coroutine) is still asleep after ``after_s``; then cancelled."""
    task = asyncio.create_task(fetch)
    await asyncio.sleep(after_s)
    waiting = not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return waiting


class _ScriptedBroker:
    """Stands in for aiokafka's one-fetch method: a fetch sent before ``lands_at`` holds
    ``hold_s`` and comes back empty (the broker at its highwater); one sent after it returns the
    record once."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.lands_at = float("inf")
        self.delivered = None  # time.monotonic() when the record was returned
        self.fetches = 0
        self.delivered_by = 0  # which fetch returned it

    async def fetch(self, assignment, node_id, request) -> bool:
        self.fetches += 1
        if time.monotonic() >= self.lands_at and self.delivered is None:
            self.delivered, self.delivered_by = time.monotonic(), self.fetches
            return True
        await asyncio.sleep(self.hold_s)
        return False


async def test_an_empty_fetch_held_past_the_window_is_followed_by_one_more(redis):
    """The window after a ring is judged by when a fetch began: the fetch sent on the ring, just
    before the record landed, is held by the broker past the window's end and comes back empty;
    one more fetch follows at once and brings the record, instead of the idle interval (a
    minute here) passing first."""
    sub = Doorbell(redis, f"t{uuid.uuid4().hex[:8]}", idle_fetch_interval_ms=60_000, expect_ms=50)
    broker = _ScriptedBroker(hold_s=0.08)
    consumer = _consumer(broker.fetch)
    sub.attach(consumer, TOPIC)
    _state, assignment = _assignment(highwater=1, position=1)  # nothing past our position

    async def routine() -> None:  # as aiokafka's background routine calls it: one fetch after another
        while True:
            await consumer._fetcher._proc_fetch_request(assignment, 0, _request())

    task = asyncio.create_task(routine())
    try:
        await until(lambda: broker.fetches == 1, 5)
        await asyncio.sleep(0.2)  # the first fetch came back empty: the consumer sleeps
        sub._bells[TOPIC].ring()
        rung_at = time.monotonic()
        await until(lambda: broker.fetches == 2, 5)  # the fetch on the ring is on its way ...
        broker.lands_at = time.monotonic()  # ... and the record lands just behind it
        await until(lambda: broker.delivered is not None, 5, lambda: f"after {broker.fetches} fetches")
        assert broker.delivered - rung_at < 1.0 and broker.delivered_by == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.close()


async def test_an_empty_answer_below_the_broker_highwater_is_fetched_again_at_once(redis):
    """The broker answered empty yet reported a highwater past the consumer's position (tansu, on a
    slowed machine, for a record acked a second before): the fetch is repeated at once, not after
    the idle interval (a minute here), and at most _BEHIND_REPEATS times in a row."""
    sub, wrapped, answers = _answering(redis, expect_ms=0)
    state, assignment = _assignment(highwater=2, position=1)
    request = _request()
    try:
        answers[:] = [False, True]  # empty below the highwater, then the records
        t0 = time.monotonic()
        async with asyncio.timeout(5):  # (the wrapper ends quietly when cancelled: the time says it)
            assert await wrapped(assignment, 0, request) is False
            assert await wrapped(assignment, 0, request) is True
            answers[:] = [False] * (_BEHIND_REPEATS + 1)  # a broker that never sends them: bounded
            for _ in range(_BEHIND_REPEATS):
                assert await wrapped(assignment, 0, request) is False
        assert time.monotonic() - t0 < 4
        assert await _still_waiting(wrapped(assignment, 0, request)), \
            "past the repeats an empty fetch waits for a ring or the idle interval"
        state.highwater = 1  # at the highwater: an empty answer waits at once
        answers[:] = [False]
        assert await _still_waiting(wrapped(assignment, 0, request))
        _other_state, unassigned = _assignment(highwater=5, position=1)
        unassigned.state_value = lambda tp: (_ for _ in ()).throw(KeyError(tp))  # revoked meanwhile
        answers[:] = [False]
        assert await _still_waiting(wrapped(unassigned, 0, request)), \
            "a partition no longer assigned is not a reason to fetch again"
    finally:
        await sub.close()


async def test_empty_fetches_inside_the_window_leave_the_highwater_repeats_whole(redis):
    """Inside the window after a ring an empty fetch is followed by another anyway: those fetches,
    however many, spend none of the repeats an empty answer below the highwater gets once the
    window has closed."""
    sub, wrapped, answers = _answering(redis, expect_ms=400)
    _state, assignment = _assignment(highwater=2, position=1)
    request = _request()
    try:
        sub._bells[TOPIC].ring()  # the window opens
        answers[:] = [False] * (_BEHIND_REPEATS + 2)
        t0 = time.monotonic()
        async with asyncio.timeout(5):
            for _ in range(_BEHIND_REPEATS + 2):  # all inside the 400 ms window
                assert await wrapped(assignment, 0, request) is False
        assert time.monotonic() - t0 < 0.4
        await asyncio.sleep(0.5)  # the window is over
        answers[:] = [False] * _BEHIND_REPEATS
        t0 = time.monotonic()
        async with asyncio.timeout(5):  # (the wrapper ends quietly when cancelled: the time says it)
            for _ in range(_BEHIND_REPEATS):
                assert await wrapped(assignment, 0, request) is False
        assert time.monotonic() - t0 < 4, "still repeated at once: the budget is whole"
    finally:
        await sub.close()
