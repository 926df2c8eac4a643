"""Running blocking model work off the event loop, and batching it across messages.

``ComputeLane``: one worker thread per process. Torch releases the GIL inside kernels, so the
loop keeps serving Kafka, Redis and NIXL progress while a forward runs; one thread (and
``torch.set_num_threads(settings.torch_threads)``) keeps a process from oversubscribing the
machine's cores.

``MicroBatcher``: callers ``submit`` single items; a loop collects up to ``max_items`` items,
waiting at most ``max_wait_ms`` after the first, runs ONE batched call on the lane and resolves
each caller's future with its own result. The pending queue is bounded (``max_pending``):
``submit`` waits for room rather than buffering without limit.

A lane's thread carries an OS-visible name (``LANE_THREAD_PREFIX`` + the lane's name, Linux), so
that per-thread CPU accounting (``loadtest/cpu.py``) can tell compute from the event loop.

``LaneBatcher``: batches with no wait. Each ``submit`` queues its item and one job on the lane;
the first job the lane runs takes every item queued by then (up to ``max_items``), so calls that
arrive while the lane is busy share one call, and a lone call starts at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

LANE_THREAD_PREFIX = "mmc-"  # the OS name of every compute lane's thread starts with this
_PR_SET_NAME = 15
_OS_NAME_MAX = 15  # bytes; Linux truncates longer names


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` as its OS name (``/proc/<pid>/task/<tid>/comm``), on
    Linux; elsewhere, or if libc refuses, nothing happens (the name only serves accounting)."""
    if not sys.platform.startswith("linux"):
        return
    try:  # the process's own symbols (libc is loaded): no library search, no subprocess
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:_OS_NAME_MAX], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ComputeLane:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{name}",
                                        initializer=name_os_thread, initargs=(LANE_THREAD_PREFIX + name,))

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(self._pool, lambda: ctx.run(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class MicroBatcher(Generic[T, R]):
    def __init__(self, fn: Callable[[Sequence[T]], Sequence[R]], lane: ComputeLane, *, max_items: int,
                 max_wait_ms: float, max_pending: int = 1024) -> None:
        self._fn = fn
        self._lane = lane
        self._max_items = max_items
        self._max_wait_s = max_wait_ms / 1000
        self._queue: asyncio.Queue[tuple[T, asyncio.Future]] = asyncio.Queue(max_pending)
        self._task: asyncio.Task | None = None
        self.batches = 0  # forwards run (for stats and tests)
        self.items = 0

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def submit(self, item: T) -> R:
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((item, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self._max_wait_s
            while len(batch) < self._max_items:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            live = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not live:
                continue
            try:
                results = await self._lane.run(self._fn, [item for item, _ in live])
            except Exception as exc:  # one bad batch fails its callers, not the loop
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.items += len(live)
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)


class _Slot:
    """One submitted item and, once its batch ran, its result or exception."""

    __slots__ = ("item", "result", "error", "dropped")

    def __init__(self, item) -> None:
        self.item, self.result, self.error, self.dropped = item, None, None, False


class LaneBatcher(Generic[T, R]):
    """``fn(items)`` returns one result per item; a result that is an ``Exception`` fails that
    caller alone (one bad prompt must not fail its batch-mates). ``fn`` raising fails the whole
    batch. At most ``max_pending`` callers wait at once; more wait for room."""

    def __init__(self, fn: Callable[[Sequence[T]], Sequence[R | Exception]], lane: ComputeLane, *, max_items: int,
                 max_pending: int = 1024) -> None:
        self._fn = fn
        self._lane = lane
        self._max_items = max(1, max_items)
        self._pending: deque[_Slot] = deque()  # appended on the loop, taken on the lane (deque ops are atomic)
        self._room = asyncio.Semaphore(max_pending)
        self.batches = 0  # calls of fn (for stats and tests)
        self.items = 0

    async def submit(self, item: T) -> R:
        async with self._room:
            slot = _Slot(item)
            self._pending.append(slot)
            # the lane runs jobs in order, so when this job is done, this item's batch has run:
            # in this job or in an earlier one that found it queued
            try:
                await self._lane.run(self._drain)
            except asyncio.CancelledError:
                slot.dropped = True  # caller gone: a later batch skips it if it is still queued
                raise
            if slot.error is not None:
                raise slot.error
            return slot.result

    def _drain(self) -> None:
        batch: list[_Slot] = []
        while self._pending and len(batch) < self._max_items:
            slot = self._pending.popleft()
            if not slot.dropped:
                batch.append(slot)
        if not batch:
            return
        try:
            results = self._fn([slot.item for slot in batch])
        except Exception as exc:
            results = [exc] * len(batch)
        self.batches += 1
        self.items += len(batch)
        for slot, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                slot.error = result
            else:
                slot.result = result
