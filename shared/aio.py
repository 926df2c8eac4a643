"""asyncio helpers shared by the fleet's long-running loops.

``wait_event(event, timeout_s)``: wait until ``event`` is set or ``timeout_s`` passes; True when
it is set. Why not ``asyncio.wait_for(event.wait(), timeout_s)``: on Python 3.11 that loses a
cancel arriving in the same loop turn as the event (it returns the inner result instead of
raising), so a loop cancelled at shutdown just as it was woken runs on, and whoever awaits it
hangs. ``asyncio.timeout`` tells its own expiry from an outside cancel.

``succeeded(fut)``: ``fut`` finished, not cancelled and without an exception.

``gather(*aws, return_exceptions=False)``: ``asyncio.gather``, except that a lone awaitable is
awaited in place. A task of its own starts a loop turn later, behind every callback ready by
then: on a stage's loop, busy with the record's own fetch and claim, that was ~1 ms of a
request's one embedding pull (measured). A cancel of the caller still raises.

``loop_factory(name)`` / ``run(main, name)``: the event loop a long-lived process runs on
(setting ``event_loop``): uvloop, the standard library's, or ``auto`` (uvloop where installed).
uvloop cut the fleet's CPU a request by ~7 % at c=8 (README, "Fleet overhead"); an explicit
``uvloop`` that is not installed is an error, not a silent fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


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


def succeeded(fut: asyncio.Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


async def gather(*aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    if len(aws) != 1:
        return await asyncio.gather(*aws, return_exceptions=return_exceptions)
    try:
        return [await aws[0]]
    except Exception as exc:
        if not return_exceptions:
            raise
        return [exc]


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``name``: the ``event_loop`` setting. None: asyncio's own loop."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise RuntimeError("event_loop = uvloop, but uvloop is not installed (pip install uvloop, "
                               "or set MMFLEET_EVENT_LOOP=asyncio)") from None
        return None  # auto
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], loop_name: str) -> T:
    """``asyncio.run(main)`` on the loop ``loop_name`` names (see :func:`loop_factory`)."""
    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        return runner.run(main)
