"""Running blocking model work off the event loop, and batching it across messages.

:class:`ComputeLane`: one worker thread per process (torch releases the GIL inside kernels, so
the loop keeps serving Kafka, Redis and NIXL while a forward runs), or the caller's thread for
a job of a kind known to be short. :class:`MicroBatcher`: single items gathered for up to
``max_wait_ms`` into ONE batched call on the lane. :class:`LaneBatcher`: batching with no wait,
calls that arrive while the lane is busy share one call.

Design: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import ctypes
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from shared.metrics import COMPUTE_JOBS

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


_EWMA_NEW = 0.25  # weight of a job's latest wall time in its kind's estimate


class ComputeLane:
    """One worker thread per process; ``torch.set_num_threads(settings.torch_threads)`` keeps a
    process from oversubscribing the cores. The thread carries an OS-visible name
    (``LANE_THREAD_PREFIX`` + the lane's name, Linux) so per-thread CPU accounting
    (``loadtest/cpu.py``) can tell compute from the event loop.

    With ``inline_max_ms``, a job runs on the caller's thread (the event loop) instead when the
    lane has no job in flight and jobs of its kind (the function's qualified name and the
    ``size`` hint within a factor of two) have lately taken at most that long: a short job then
    costs no thread hand-over and no GIL ping-pong with the loop, at the price of the loop
    waiting for it. A kind not seen yet runs on the thread."""

    def __init__(self, name: str, *, inline_max_ms: float = 0.0) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"compute-{name}", initializer=name_os_thread,
            initargs=(LANE_THREAD_PREFIX + name,))
        self._inline_max_s = inline_max_ms / 1000
        # jobs handed to the thread and not finished (a cancelled caller's job may still run)
        self._jobs: set[concurrent.futures.Future] = set()
        self._wall_s: dict[str, float] = {}  # job kind -> its recent wall time (EWMA); unknown kinds use the thread
        self.inlined = 0  # jobs run on the caller's thread (for stats and tests)
        self.threaded = 0
        self._count_inline = COMPUTE_JOBS.labels(name, "inline")
        self._count_thread = COMPUTE_JOBS.labels(name, "thread")

    async def run(self, fn: Callable[..., R], *args: Any, size: int = 0) -> R:
        """``size``: how big the job is (tokens, bytes: what its time grows with), for inlining."""
        ctx = contextvars.copy_context()
        key = f"{getattr(fn, '__qualname__', None) or type(fn).__qualname__}/{max(size, 0).bit_length()}"
        wall_s = self._wall_s.get(key)
        short = wall_s is not None and wall_s <= self._inline_max_s
        if short and not self._jobs:
            # one loop turn first: what is ready goes out before the loop is held (a claim's
            # command, a fetch a ring woke), and a batcher's callers ready now join this job
            await asyncio.sleep(0)
        if short and not self._jobs:  # (again: the turn may have handed a job to the thread)
            # nothing on the thread to race with: the same order and exclusion as a threaded job
            self.inlined += 1
            self._count_inline.inc()
            return self._timed(key, ctx, fn, args)
        self.threaded += 1
        self._count_thread.inc()
        job = self._pool.submit(self._timed, key, ctx, fn, args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)  # run, failed or cancelled before it ran
        return await asyncio.wrap_future(job)

    def _timed(self, key: str, ctx: contextvars.Context, fn: Callable[..., R], args: tuple) -> R:
        if not self._inline_max_s:
            return ctx.run(fn, *args)
        t0 = time.perf_counter()
        try:
            return ctx.run(fn, *args)
        finally:
            took = time.perf_counter() - t0
            old = self._wall_s.get(key)
            self._wall_s[key] = took if old is None else old + _EWMA_NEW * (took - old)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class MicroBatcher(Generic[T, R]):
    """Callers ``submit`` single items; a loop collects up to ``max_items`` items, waiting at most
    ``max_wait_ms`` after the first, runs ONE batched call on the lane and resolves each caller's
    future with its own result. The pending queue is bounded (``max_pending``): ``submit`` waits
    for room rather than buffering without limit."""

    def __init__(self, fn: Callable[[Sequence[T]], Sequence[R]], lane: ComputeLane, *, max_items: int,
                 max_wait_ms: float, max_pending: int = 1024, size_of: Callable[[T], int] | None = None) -> None:
        self._fn = fn
        self._size_of = size_of  # an item's size hint for the lane (ComputeLane.run's ``size``)
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
                items = [item for item, _ in live]
                size = sum(map(self._size_of, items)) if self._size_of is not None else 0
                results = await self._lane.run(self._fn, items, size=size)
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
    """Batches with no wait: each ``submit`` queues its item and one job on the lane; the first
    job the lane runs takes every item queued by then (up to ``max_items``), so calls that arrive
    while the lane is busy share one call, and a lone call starts at once.

    ``fn(items)`` returns one result per item; a result that is an ``Exception`` fails that
    caller alone (one bad prompt must not fail its batch-mates). ``fn`` raising fails the whole
    batch. At most ``max_pending`` callers wait at once; more wait for room."""

    def __init__(self, fn: Callable[[Sequence[T]], Sequence[R | Exception]], lane: ComputeLane, *, max_items: int,
                 max_pending: int = 1024, size_of: Callable[[T], int] | None = None) -> None:
        self._fn = fn
        self._size_of = size_of  # as MicroBatcher's
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
            # in this job or in an earlier one that found it queued (a job run inline, the lane's
            # thread idle, takes this item and those queued during its one-turn yield)
            try:
                await self._lane.run(self._drain, size=self._size_of(item) if self._size_of is not None else 0)
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
