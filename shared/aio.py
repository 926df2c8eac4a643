"""asyncio helpers shared by the fleet's long-running loops.

``wait_event(event, timeout_s)``: wait until ``event`` is set or ``timeout_s`` passes; True when
it is set. Why not ``asyncio.wait_for(event.wait(), timeout_s)``: on Python 3.11 that loses a
cancel arriving in the same loop turn as the event (it returns the inner result instead of
raising), so a loop cancelled at shutdown just as it was woken runs on, and whoever awaits it
hangs. ``asyncio.timeout`` tells its own expiry from an outside cancel.

``succeeded(fut)``: ``fut`` finished, not cancelled and without an exception.
"""

from __future__ import annotations

import asyncio


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
