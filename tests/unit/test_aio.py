"""shared.aio.wait_event: set / timeout answers, and a cancel arriving in the same loop turn as
the wake-up is never lost (Python 3.11's wait_for loses it: a cancelled loop would run on)."""

from __future__ import annotations

import asyncio

from shared.aio import wait_event


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
