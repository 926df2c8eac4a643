"""asyncio helpers shared by the fleet's long-running loops: an event wait that keeps a cancel
(:func:`wait_event`), a ``gather`` that awaits a lone awaitable in place, and the event loop a
long-lived process runs on (:func:`loop_factory`: uvloop, asyncio's, or ``auto``).

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True when it is set.

    Not ``asyncio.wait_for(event.wait(), timeout_s)``: on Python 3.11 that loses a cancel arriving
    in the same loop turn as the event (it returns instead of raising), so a loop cancelled at
    shutdown just as it was woken runs on. ``asyncio.timeout`` tells its own expiry from a cancel."""
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
    """``fut`` finished, not cancelled and without an exception."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


async def gather(*aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather``, except that a lone awaitable is awaited in place: a task of its own
    starts a loop turn later, behind every ready callback (~1 ms of a request's one embedding
    pull on a busy stage loop, measured). A cancel of the caller still raises."""
    if len(aws) != 1:
        return await asyncio.gather(*aws, return_exceptions=return_exceptions)
    try:
        return [await aws[0]]
    except Exception as exc:
        if not return_exceptions:
            raise
        return [exc]


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``name``: the ``event_loop`` setting. None: asyncio's own loop. ``auto`` takes uvloop where
    installed; an explicit ``uvloop`` that is not installed is an error, not a silent fallback."""
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
