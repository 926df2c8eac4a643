"""Running blocking model work off the event loop, and batching it across messages.

``ComputeLane``: one worker thread per process. Torch releases the GIL inside kernels, so the
loop keeps serving Kafka, Redis and NIXL progress while a forward runs; one thread (and
``torch.set_num_threads(settings.torch_threads)``) keeps a process from oversubscribing the
machine's cores.

``MicroBatcher``: callers ``submit`` single items; a loop collects up to ``max_items`` items,
waiting at most ``max_wait_ms`` after the first, runs ONE batched call on the lane and resolves
each caller's future with its own result. The pending queue is bounded (``max_pending``):
``submit`` waits for room rather than buffering without limit.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ComputeLane:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{name}")

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
