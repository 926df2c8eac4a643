"""asyncio helpers shared by the fleet's long-running loops.

``run(coro, event_loop)``: ``asyncio.run`` on the loop the ``event_loop`` setting names (uvloop
or the standard library's), for every long-running fleet process.

``wait_event(event, timeout_s)``: wait until ``event`` is set or ``timeout_s`` passes; True when
it is set. Why not ``asyncio.wait_for(event.wait(), timeout_s)``: on Python 3.11 that loses a
cancel arriving in the same loop turn as the event (it returns the inner result instead of
raising), so a loop cancelled at shutdown just as it was woken runs on, and whoever awaits it
hangs. ``asyncio.timeout`` tells its own expiry from an outside cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if event_loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if event_loop == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"unknown event loop {event_loop!r}")


def run(coro: Coroutine[Any, Any, T], event_loop: str) -> T:
    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        return runner.run(coro)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    if event.is_set():
        return True
    if timeout_s <= 0:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
