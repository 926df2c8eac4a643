"""shared.transport.doorbell._RingWire with a stand-in connection: close() ends the ring task even when
the write in flight swallows the cancel (redis-py writes under asyncio.wait_for when its pool
sets a socket timeout, and Python 3.11's wait_for can lose a cancel), and rings after close()
are dropped. Rings against a real Redis: tests/transport/test_doorbell.py."""

from __future__ import annotations

import asyncio

from shared.transport.doorbell import _RingWire


class _SwallowingConn:
    """A ring connection whose write never ends and eats the first cancel it gets."""

    _writer = None  # no transport to write to within send(): rings go through the task

    def __init__(self) -> None:
        self.writing = asyncio.Event()
        self.swallowed = 0
        self.disconnected = False

    def pack_commands(self, commands):
        return [repr(commands).encode()]

    async def send_packed_command(self, command, check_health=True) -> None:
        self.writing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.swallowed += 1  # as a wait_for whose inner finished in the cancel's loop turn

    async def can_read(self) -> bool:
        return False

    async def disconnect(self) -> None:
        self.disconnected = True


async def test_close_ends_the_ring_task_when_its_write_swallows_the_cancel():
    wire = _RingWire(redis=None)
    conn = wire._conn = _SwallowingConn()
    wire._check_at = asyncio.get_running_loop().time() + 60
    wire.send("ch", b"x")
    await asyncio.wait_for(conn.writing.wait(), 5)
    await asyncio.wait_for(wire.close(), 5)  # hung before: the task went back to waiting for rings
    assert conn.swallowed == 1 and conn.disconnected and wire._task is None
    wire.send("ch", b"late")  # after close: dropped, no task started again
    assert wire._task is None and wire._queue == []
