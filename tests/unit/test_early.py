"""shared.transport.early's rules without a broker: which carried copies start a run, how a run waits for
its record (and its stream writes with it), and when it is dropped."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from shared import protocol
from shared.transport.delivery import Unconfirmed
from shared.transport.early import EarlyStarts
from shared.transport.ledger import CLAIMED, WriteGuard


def _msg(rid: str = "r1") -> protocol.PrefillRequest:
    now = int(time.time() * 1000)
    return protocol.PrefillRequest(meta=protocol.RequestMeta(request_id=rid, model="m", created_unix_ms=now,
                                                             deadline_unix_ms=now + 60_000, prompt_token_ids=(1,)))


def _payload(msg, partition: int = 0) -> tuple[bytes, bytes]:
    value = protocol.encode(msg)
    return protocol.encode(protocol.CarriedRecord(partition=partition, sent_unix_ms=1, value=value)), value


class _Env:
    def __init__(self, *, owned=(0,), free=8, confirm_ms=5_000) -> None:
        self.started: list = []
        self.gate = asyncio.Event()
        self.owned = set(owned)
        self.slots = free
        self.early = EarlyStarts(decoder=protocol.decoder_for(protocol.PrefillRequest), start=self._start,
                                 owns=lambda p: p in self.owned, free=lambda: self.slots, confirm_ms=confirm_ms,
                                 stage="unit")

    async def _start(self, run) -> None:
        self.started.append(run)
        run.handled = True
        await self.gate.wait()
        await run.confirmed()


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("mmfleet_early_starts_total", {"stage": "unit", "outcome": outcome}) or 0.0


class _Sink:
    """An EventSink recording what is written (appends and compare-and-appends alike)."""

    def __init__(self) -> None:
        self.written: list = []

    async def append(self, rid, event):
        self.written.append(event)

    async def append_delta(self, rid, delta, position):
        self.written.append((delta, position))
        return True

    async def history(self, rid):
        return list(self.written)


class _GuardedSink(_Sink):
    """A sink whose Redis checks a write's guard itself: ``shows`` is whether it is met there."""

    def __init__(self) -> None:
        super().__init__()
        self.shows = False
        self.guards: list[WriteGuard] = []

    async def append_delta_if(self, rid, delta, position, guard):
        self.guards.append(guard)
        return await self.append_delta(rid, delta, position) if self.shows else None


async def _started(env: _Env, msg) -> object:
    """Offer ``msg``'s carried copy; the run it started."""
    env.early.offer(_payload(msg)[0])
    await asyncio.sleep(0)
    return env.started[-1]


def _rec(value: bytes, partition: int = 0, offset: int = 0):
    return SimpleNamespace(partition=partition), SimpleNamespace(value=value, offset=offset)


async def test_a_copy_for_an_owned_partition_with_a_free_slot_starts_once():
    env = _Env()
    msg = _msg()
    payload, _ = _payload(msg)
    env.early.offer(payload)
    env.early.offer(payload)  # the same record again (a second ring): still one run
    await asyncio.sleep(0)
    assert len(env.started) == 1 and env.started[0].msg == msg


@pytest.mark.parametrize("why", ["not owned", "no slot", "undecodable", "delivered already"])
async def test_a_copy_starts_nothing(why):
    env = _Env(owned=() if why == "not owned" else (0,), free=0 if why == "no slot" else 8)
    payload, value = _payload(_msg())
    if why == "undecodable":
        payload = protocol.encode(protocol.CarriedRecord(partition=0, sent_unix_ms=1, value=b"\x01garbage"))
    if why == "delivered already":
        assert env.early.adopt(*_rec(value)) is None  # Kafka first: nothing to adopt, remembered
    env.early.offer(payload)
    env.early.offer(b"not a carried record at all")
    await asyncio.sleep(0)
    assert env.started == [] and env.early.started == 0


async def test_slots_taken_by_early_runs_count_against_the_concurrency():
    env = _Env(free=1)
    env.early.offer(_payload(_msg("a"))[0])
    env.early.offer(_payload(_msg("b"))[0])
    await asyncio.sleep(0)
    assert [r.msg.meta.request_id for r in env.started] == ["a"]


async def test_adopt_hands_the_record_to_the_waiting_run_and_its_stream_writes():
    env = _Env()
    before = _count("started"), _count("adopted")
    run = await _started(env, _msg())
    value = run.value
    sink = _Sink()
    written = sink.written
    gated = run.gate(sink)
    writer = asyncio.create_task(gated.append("r1", "ev"))
    await asyncio.sleep(0.05)
    assert written == [] and await gated.history("r1") == []  # reads go through, writes wait
    tp, rec = _rec(value, partition=1)
    assert env.early.adopt(tp, rec) is None  # another partition's record is not this copy's
    tp, rec = _rec(value)
    assert env.early.adopt(tp, rec) is run
    await writer
    assert written == ["ev"]
    env.gate.set()
    await run.task
    assert await run.confirmed() == (tp, rec) and not env.early._runs
    assert (_count("started"), _count("adopted")) == (before[0] + 1, before[1] + 1)


async def test_a_record_that_does_not_come_in_time_drops_the_run():
    env = _Env(confirm_ms=100)
    dropped = _count("dropped")
    payload, value = _payload(_msg())
    env.early.offer(payload)
    await asyncio.sleep(0)
    run = env.started[0]
    env.gate.set()
    await run.task  # Unconfirmed inside, logged: the task itself ends quietly
    assert run.dropped and not env.early._runs and _count("dropped") == dropped + 1
    with pytest.raises(Unconfirmed):
        await run.confirmed()
    assert env.early.adopt(*_rec(value)) is None  # the record, come late, runs as usual


async def test_revoked_partitions_and_close_end_the_runs_not_adopted():
    env = _Env(owned=(0, 1))
    env.early.offer(_payload(_msg("a"), partition=0)[0])
    env.early.offer(_payload(_msg("b"), partition=1)[0])
    await asyncio.sleep(0)
    a, b = env.started
    env.early.drop_partitions({0})
    await asyncio.gather(a.task, return_exceptions=True)
    assert a.task.cancelled() and not b.task.done()
    await env.early.close()
    assert b.task.cancelled() and not env.early._runs


def _acked(msg, partition: int = 0, attempt: int | None = None, offset: int = 7) -> bytes:
    return protocol.encode(protocol.AckedRecord(partition=partition, offset=offset, request_id=msg.meta.request_id,
                                                attempt=msg.meta.attempt if attempt is None else attempt))


async def test_the_brokers_ack_releases_stream_writes_and_only_delivery_the_rest():
    env = _Env()
    msg = _msg()
    run = await _started(env, msg)
    value = run.value
    sink = _Sink()
    written = sink.written
    gated = run.gate(sink)
    writer = asyncio.create_task(gated.append_delta("r1", "d0", 0))
    confirmed = asyncio.create_task(run.confirmed())
    env.early.offer(_acked(msg, partition=1))  # another partition's record: not this run's
    env.early.offer(_acked(msg, attempt=1))  # another attempt's
    await asyncio.sleep(0.05)
    assert written == [] and not confirmed.done()
    env.early.offer(_acked(msg))  # in Kafka now: the stream write goes, the rest still waits for delivery
    await writer
    assert written == [("d0", 0)]
    await asyncio.sleep(0.05)
    assert not confirmed.done()
    tp, rec = _rec(value)
    assert env.early.adopt(tp, rec) is run
    assert await confirmed == (tp, rec)
    env.gate.set()
    await run.task
    assert not env.early._runs and not env.early._by_request


async def test_an_ack_for_a_record_delivered_here_asks_for_no_fetch():
    """``offer`` answers whether a ring is worth a fetch: an ack's ring for a record Kafka has
    delivered here already is not (the doorbell then wakes nobody), one still to come is."""
    env = _Env(owned=(0, 1))
    msg = _msg()
    assert env.early.offer(_payload(msg)[0]) is True  # a carried copy always wakes
    assert env.early.offer(_acked(msg, offset=5)) is True  # acked, not delivered yet: fetch it
    env.early.adopt(*_rec(b"some record", offset=5))  # Kafka delivered offset 5 of partition 0
    assert env.early.offer(_acked(msg, offset=5)) is False
    assert env.early.offer(_acked(msg, offset=4)) is False
    assert env.early.offer(_acked(msg, offset=6)) is True  # a later record of that partition
    assert env.early.offer(_acked(msg, partition=1, offset=2)) is True  # nothing delivered from partition 1
    env.early.drop_partitions({0})  # revoked: what was delivered here says nothing any more
    assert env.early.offer(_acked(msg, offset=5)) is True
    env.early.adopt(*_rec(b"another record", offset=9))
    env.early.adopt(*_rec(b"after a broker lost its log", offset=0))  # offsets start again
    assert env.early.offer(_acked(msg, offset=1)) is True
    env.gate.set()
    await asyncio.gather(*(r.task for r in env.started), return_exceptions=True)


async def test_a_dropped_run_writes_nothing_even_once_acked():
    env = _Env(confirm_ms=100)
    msg = _msg()
    run = await _started(env, msg)
    sink = _Sink()
    written = sink.written
    gated = run.gate(sink)
    with pytest.raises(Unconfirmed):  # neither acked nor delivered within the bound
        await gated.append("r1", "ev")
    assert run.dropped
    env.early.offer(_acked(msg))  # late: the run is gone
    with pytest.raises(Unconfirmed):
        await gated.append("r1", "ev")
    assert written == []
    env.gate.set()
    await asyncio.gather(run.task, return_exceptions=True)


async def test_a_delta_the_run_cannot_vouch_for_yet_is_a_guarded_append():
    """Before the run has seen its claim's reply and its record's ack, a delta goes as a guarded
    append: written at once when Redis shows the guard met (the claim the run's, the record
    acked); when not, the write waits for the claim and the ack as before. Once the run has seen
    both, its appends are plain ones."""
    env = _Env()
    msg = _msg()
    run = await _started(env, msg)
    claim = asyncio.get_running_loop().create_future()
    guard = WriteGuard("claim-key", "w1", "acked-key", 0)
    run.claim(claim, guard)
    sink = _GuardedSink()
    gated = run.gate(sink)
    sink.shows = True
    assert await gated.append_delta("r1", "d0", 0) is True
    assert sink.written == [("d0", 0)] and sink.guards == [guard]
    sink.shows = False  # (say the ack is not in Redis yet)
    writer = asyncio.create_task(gated.append_delta("r1", "d1", 1))
    await asyncio.sleep(0.05)
    assert not writer.done() and sink.written == [("d0", 0)] and len(sink.guards) == 2
    claim.set_result(CLAIMED)
    env.early.offer(_acked(msg))
    assert await writer is True and sink.written == [("d0", 0), ("d1", 1)]
    assert await gated.append_delta("r1", "d2", 2) and len(sink.guards) == 2  # known now: unguarded
    env.gate.set()
    assert env.early.adopt(*_rec(run.value)) is run
    await run.task


async def test_a_dropped_run_makes_no_guarded_append():
    env = _Env(confirm_ms=100)
    run = await _started(env, _msg())
    claim = asyncio.get_running_loop().create_future()
    claim.set_result(CLAIMED)
    run.claim(claim, WriteGuard("c", "w1", "a", 0))
    sink = _GuardedSink()
    sink.shows = True
    gated = run.gate(sink)
    run.drop()
    with pytest.raises(Unconfirmed):
        await gated.append_delta("r1", "d0", 0)
    assert sink.guards == [] and sink.written == []
    env.gate.set()
    await asyncio.gather(run.task, return_exceptions=True)


class _QueuingSink(_Sink):
    """A sink that can queue an append without waiting (Redis's ``append_delta_soon``)."""

    def append_delta_soon(self, rid, delta, position):
        fut = asyncio.get_running_loop().create_future()
        self.written.append((delta, position))
        fut.set_result(1)
        return fut


async def test_appends_are_queued_through_the_gate_only_once_the_run_may_write():
    """A queued append is not awaited, so the gate offers it only when the run would write at
    once: the claim its own and the record in Kafka. Before (and after a drop) the writer has to
    await ``append_delta``, which waits or fails as above."""
    env = _Env()
    msg = _msg()
    run = await _started(env, msg)
    claim = asyncio.get_running_loop().create_future()
    run.claim(claim)
    sink = _QueuingSink()
    gated = run.gate(sink)
    assert gated.append_delta_soon("r1", "d0", 0) is None  # neither claim nor ack seen
    env.early.offer(_acked(msg))
    assert gated.append_delta_soon("r1", "d0", 0) is None  # acked, the claim still in flight
    claim.set_result(CLAIMED)
    fut = gated.append_delta_soon("r1", "d0", 0)
    assert fut is not None and fut.result() == 1 and sink.written == [("d0", 0)]
    run.drop()
    assert gated.append_delta_soon("r1", "d1", 1) is None
    assert sink.written == [("d0", 0)]
    env.gate.set()
    await asyncio.gather(run.task, return_exceptions=True)


async def test_a_run_whose_claim_is_held_elsewhere_queues_nothing():
    env = _Env()
    msg = _msg()
    run = await _started(env, msg)
    claim = asyncio.get_running_loop().create_future()
    run.claim(claim)
    claim.set_result("held")  # not CLAIMED: another worker's
    env.early.offer(_acked(msg))
    await asyncio.sleep(0)
    sink = _QueuingSink()
    assert run.gate(sink).append_delta_soon("r1", "d0", 0) is None and sink.written == []
    env.gate.set()
    await asyncio.gather(run.task, return_exceptions=True)
