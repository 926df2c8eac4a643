"""shared.process.aio.wait_event: set / timeout answers, and a cancel arriving in the same loop turn as
the wake-up is never lost (Python 3.11's wait_for loses it: a cancelled loop would run on).
shared.process.aio.gather: asyncio.gather's answers, a lone awaitable run in place (ahead of what is ready).
shared.process.aio.run / loop_factory: the loop the event_loop setting names; uvloop asked for and missing
is an error, auto falls back to asyncio's."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from shared.process import aio
from shared.process.aio import gather, wait_event
from shared.settings import Settings


async def test_set_timeout_and_already_set():
    ev = asyncio.Event()
    assert not await wait_event(ev, 0.01)
    assert not await wait_event(ev, 0)
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_event(ev, 5)
    assert await wait_event(ev, 0)  # already set: at once, even with no time left


async def test_a_cancel_in_the_same_turn_as_the_wake_up_ends_the_loop():
    ev = asyncio.Event()
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            ev.clear()
            await wait_event(ev, 10)
            turns += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    ev.set()
    task.cancel()  # the wake-up and the cancel in one turn
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done and task.cancelled(), "the cancel was lost: the loop ran on"
    assert turns == 0


async def test_gather_runs_a_lone_awaitable_in_place_and_answers_as_asyncio_gather():
    order: list[str] = []

    async def work(name: str, fail: bool = False) -> str:
        order.append(name)
        if fail:
            raise ValueError(name)
        await asyncio.sleep(0)
        return name

    asyncio.get_running_loop().call_soon(order.append, "ready before")
    assert await gather(work("alone")) == ["alone"]
    assert order[:2] == ["alone", "ready before"]  # asyncio.gather's task would start after the callback
    assert await gather(work("a"), work("b")) == ["a", "b"]
    assert await gather() == []
    failed = await gather(work("bad", fail=True), return_exceptions=True)
    assert isinstance(failed[0], ValueError)
    with pytest.raises(ValueError):
        await gather(work("bad", fail=True))
    mixed = await gather(work("ok"), work("bad", fail=True), return_exceptions=True)
    assert mixed[0] == "ok" and isinstance(mixed[1], ValueError)


async def test_gather_lets_a_cancel_of_its_caller_through():
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(10)

    task = asyncio.create_task(gather(slow(), return_exceptions=True))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize("name", ["uvloop", "auto"])
def test_run_on_uvloop(name):
    assert aio.run(_loop_type(), name) is uvloop.Loop


def test_run_on_asyncios_loop_and_the_default():
    loop_type = aio.run(_loop_type(), "asyncio")
    assert loop_type is not uvloop.Loop and issubclass(loop_type, asyncio.BaseEventLoop)
    assert Settings().event_loop == "auto"


def test_uvloop_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        aio.loop_factory("uvloop")
    assert aio.loop_factory("auto") is None
    assert aio.run(_loop_type(), "auto") is not uvloop.Loop


def test_an_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="event_loop must be one of"):
        Settings(event_loop="trio")
