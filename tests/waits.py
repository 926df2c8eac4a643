"""Polling a condition in async tests: ``await until(pred, timeout_s)`` fails the test with
``why()`` when ``pred()`` is still false at the deadline."""

from __future__ import annotations

import asyncio
import time


async def until(pred, timeout_s: float, why=lambda: "", *, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"condition not reached in time {why()}"
        await asyncio.sleep(poll_s)
