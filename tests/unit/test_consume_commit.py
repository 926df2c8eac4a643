"""ConsumeLoop commits: bounded in time, and never across a broker restart (see the
COMMIT_TIMEOUT_MS comment in shared/transport/consume.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from shared.settings import Settings
from shared.transport import consume
from shared.transport.consume import ConsumeLoop, OffsetTracker
from shared.transport.ledger import EpochWatch

TP = TopicPartition("t", 0)


class _Consumer:
    """Stands in for the aiokafka consumer: assignment, seeks and commits recorded; a commit
    waits for ``answer`` (the broker away: aiokafka waits for a coordinator)."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.committed: list[dict] = []
        self.sought: list[tuple] = []

    def assignment(self):
        return {TP}

    async def commit(self, offsets):
        await self.answer.wait()
        self.committed.append(offsets)

    async def seek_to_beginning(self, *parts):
        self.sought.append(parts)


def _loop(epochs: list[bytes]) -> tuple[ConsumeLoop, _Consumer]:
    async def read():
        return epochs[0] if len(epochs) == 1 else epochs.pop(0)

    loop = ConsumeLoop(Settings(), "t", "g", name="t", concurrency=4, poll_timeout_ms=100,
                       process=lambda tp, rec: None, epoch=EpochWatch(read))
    fake = _Consumer()
    loop._consumer = fake
    tracker = loop._trackers[TP] = OffsetTracker()
    tracker.begin(0)
    tracker.done(0)
    return loop, fake


@pytest.mark.asyncio
async def test_an_unanswered_commit_is_abandoned_and_retried_by_the_next(monkeypatch):
    monkeypatch.setattr(consume, "COMMIT_TIMEOUT_MS", 50)
    loop, fake = _loop([b"e1"])
    await loop._commit()  # the first epoch read is the reference
    await asyncio.wait_for(loop._commit(), 5)  # returns: the commit was given up, not awaited for ever
    assert fake.committed == [] and loop._trackers[TP].committable() == 1  # still owed
    fake.answer.set()
    await loop._commit()
    assert fake.committed == [{TP: 1}] and loop._trackers[TP].committable() is None


@pytest.mark.asyncio
async def test_a_changed_epoch_drops_the_watermarks_instead_of_committing_them():
    loop, fake = _loop([b"e1", b"e2"])
    fake.answer.set()
    assert await loop._epoch.changed() is False  # e1: the reference
    await loop._commit()  # e2: the broker was restarted
    assert fake.committed == [] and loop._trackers == {} and fake.sought == [(TP,)]


def test_the_restart_grace_outlasts_a_commit():
    assert consume.BROKER_RESTART_GRACE_MS > consume.COMMIT_TIMEOUT_MS
