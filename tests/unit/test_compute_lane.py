"""ComputeLane's inline path: a short job of a known kind runs on the event loop's thread when
the lane's thread is idle; everything else (unknown kinds or sizes, long kinds, a busy thread)
runs on the thread, in order, never two jobs at once."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from shared.process.compute import ComputeLane, LaneBatcher, MicroBatcher

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="caller")


def where() -> int:
    return threading.get_ident()


def sleeper(seconds: float) -> int:
    time.sleep(seconds)
    return threading.get_ident()


@pytest.fixture
def lanes():
    """``lanes(inline_max_ms)``: a new lane, closed after the test."""
    made: list[ComputeLane] = []

    def make(inline_max_ms: float = 0.0) -> ComputeLane:
        made.append(ComputeLane("t", inline_max_ms=inline_max_ms))
        return made[-1]

    yield make
    for lane in made:
        lane.close()


@pytest.fixture
def gate(lanes):
    """An event a lane job can block on; set before the lanes close (their close waits for it)."""
    event = threading.Event()
    yield event
    event.set()


async def test_without_a_bound_every_job_runs_on_the_thread(lanes):
    lane = lanes()
    loop_thread = threading.get_ident()
    assert loop_thread not in {await lane.run(where) for _ in range(3)}
    assert (lane.inlined, lane.threaded) == (0, 3)


async def test_a_known_short_kind_runs_inline_and_a_new_size_on_the_thread_first(lanes):
    lane = lanes(50)
    loop_thread = threading.get_ident()
    assert await lane.run(where, size=100) != loop_thread  # kind not seen yet: the thread
    assert await lane.run(where, size=100) == loop_thread
    assert await lane.run(where, size=120) == loop_thread  # within a factor of two: the same size class
    assert await lane.run(where, size=1000) != loop_thread  # a bigger class: measured on the thread first
    assert await lane.run(where, size=1000) == loop_thread
    assert (lane.inlined, lane.threaded) == (3, 2)


async def test_a_kind_slower_than_the_bound_stays_on_the_thread(lanes):
    lane = lanes(5)
    loop_thread = threading.get_ident()
    for _ in range(3):
        assert await lane.run(sleeper, 0.02) != loop_thread
    assert lane.inlined == 0


async def test_a_busy_thread_keeps_later_jobs_off_the_loop_and_in_order(lanes, gate):
    lane = lanes(50)
    order: list[str] = []

    def mark(name: str) -> int:
        order.append(name)
        return threading.get_ident()

    loop_thread = threading.get_ident()
    await lane.run(mark, "warm")  # the kind is known and short from here on
    busy = asyncio.ensure_future(lane.run(gate.wait))
    await asyncio.sleep(0.01)
    later = asyncio.ensure_future(lane.run(mark, "after the busy job"))
    await asyncio.sleep(0.01)
    assert not later.done()  # queued behind the busy job, not run on the loop beside it
    gate.set()
    await busy
    assert await later != loop_thread
    assert await lane.run(mark, "idle again") == loop_thread
    assert order == ["warm", "after the busy job", "idle again"]


async def test_a_cancelled_callers_job_still_holds_the_thread(lanes, gate):
    lane = lanes(50)
    loop_thread = threading.get_ident()
    await lane.run(where)
    busy = asyncio.ensure_future(lane.run(gate.wait))
    await asyncio.sleep(0.01)
    busy.cancel()  # its job keeps running on the thread: nothing may run beside it
    await asyncio.sleep(0.01)
    nxt = asyncio.ensure_future(lane.run(where))
    await asyncio.sleep(0.01)
    assert not nxt.done()
    gate.set()
    assert await nxt != loop_thread
    assert await lane.run(where) == loop_thread


async def test_an_inline_job_sees_a_copy_of_the_callers_context_and_raises_as_usual(lanes):
    lane = lanes(50)

    def setter(value: str) -> str:
        VAR.set(value)
        if value == "boom":
            raise ValueError(value)
        return VAR.get()

    await lane.run(setter, "warm")
    assert lane.inlined == 0
    assert await lane.run(setter, "inside") == "inside"
    assert lane.inlined == 1
    assert VAR.get() == "caller"  # the job's context was a copy, as on the thread
    try:
        await lane.run(setter, "boom")
    except ValueError as exc:
        assert str(exc) == "boom"
    else:
        raise AssertionError("the inline job's exception was lost")


async def test_batchers_pass_their_size_hints_and_inline_keeps_their_results(lanes):
    lane = lanes(50)
    sizes: list[int] = []
    real_run = lane.run

    async def spy(fn, *args, size=0):
        sizes.append(size)
        return await real_run(fn, *args, size=size)

    lane.run = spy
    lanes = LaneBatcher(lambda items: [i * 2 for i in items], lane, max_items=4, size_of=lambda i: i)
    micro = MicroBatcher(lambda items: [i + 1 for i in items], lane, max_items=4, max_wait_ms=1,
                         size_of=lambda i: i)
    await micro.start()
    try:
        assert [await lanes.submit(i) for i in (3, 3, 3)] == [6, 6, 6]
        assert await asyncio.gather(micro.submit(5), micro.submit(6)) == [6, 7]
        assert sizes == [3, 3, 3, 11]  # a LaneBatcher job: its item's size; a MicroBatcher's: its batch's sum
        assert lane.inlined >= 2  # the LaneBatcher's second and third ran on the loop
    finally:
        await micro.stop()


async def test_callers_ready_together_share_one_inline_batch(lanes):
    lane = lanes(50)
    seen: list[list[int]] = []
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def fn(items):
        seen.append(list(items))
        threads.append(threading.get_ident())
        return [i * 10 for i in items]

    batcher = LaneBatcher(fn, lane, max_items=8, size_of=lambda i: 1)
    assert await batcher.submit(1) == 10  # the kind's first job: on the thread, measured
    assert await asyncio.gather(*(batcher.submit(i) for i in (2, 3, 4))) == [20, 30, 40]
    # the inline job yields one loop turn before it holds the loop: the callers ready by then join it
    assert seen == [[1], [2, 3, 4]]
    assert threads[0] != loop_thread and threads[1] == loop_thread
