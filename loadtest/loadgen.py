"""Load shapes: who decides when each request of a workload is sent.

- ``concurrency``: ``value`` requests in flight at all times (closed loop);
- ``rate``: Poisson arrivals at ``value`` requests/s (seeded exponential gaps), optionally
  capped at ``max_concurrency`` in flight;
- ``sessions``: ``value`` users at once, each sending its session's turns one after another
  (a turn only after the previous one's answer), then a waiting user's, until all are sent.
Every run stops by itself: at most ``max_requests`` requests (the workload cycled if shorter),
none after ``duration_s``; requests then in flight get ``grace_s``, then are cancelled (errors).
A sweep is several shapes run one after another on the same workload.
Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from loadtest.client import RequestRecord


@dataclass(frozen=True)
class LoadShape:
    kind: str  # "concurrency" | "rate" | "sessions"
    value: float
    max_requests: int
    duration_s: float = 60.0
    grace_s: float = 60.0
    max_concurrency: int | None = None  # rate only
    seed: int = 0

    @property
    def label(self) -> str:
        if self.kind == "rate":
            return f"rate={self.value:g}/s"
        return f"{'users' if self.kind == 'sessions' else 'c'}={int(self.value)}"

    def to_dict(self) -> dict:
        return asdict(self)


def poisson_gaps(rate_per_s: float, n: int, seed: int) -> list[float]:
    """``n`` inter-arrival gaps (s) of a Poisson process at ``rate_per_s`` (mean 1/rate)."""
    if rate_per_s <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    return [rng.expovariate(rate_per_s) for _ in range(n)]


SendFn = Callable[[int, float], Awaitable[RequestRecord]]  # (request number, run t0) -> record


@dataclass
class RunTiming:
    t0: float  # perf_counter at the start
    duration_s: float  # first send → last completion
    stopped_by: str  # "count" | "time"


async def drive(shape: LoadShape, send: SendFn, *, on_done: Callable[[RequestRecord], None] | None = None,
                sessions: list[list[int]] | None = None) -> tuple[list[RequestRecord], RunTiming]:
    """Run ``shape``; ``send(i, t0)`` sends request number ``i`` (0-based, in order; ``sessions``
    shape: the indices of each session, in turn order). Returns one record per request sent, in
    completion order."""
    if shape.kind not in ("concurrency", "rate", "sessions"):
        raise ValueError(f"unknown load shape {shape.kind!r}; choose concurrency, rate or sessions")
    if shape.kind == "sessions" and not sessions:
        raise ValueError("the sessions load shape needs the workload's sessions")
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def tracked(i: int) -> None:
        rec = None
        try:
            rec = await send(i, t0)
        except asyncio.CancelledError:
            rec = RequestRecord(index=i, start_s=time.perf_counter() - t0,
                                error="cancelled: still running past the run's time bound")
            raise
        finally:
            if rec is not None:
                records.append(rec)
                if on_done:
                    on_done(rec)

    if shape.kind == "sessions":
        stopped_by = await _sessions_loop(shape, tracked, t0, sessions or [])
    else:
        stopped_by = await (_closed_loop if shape.kind == "concurrency" else _open_loop)(shape, tracked, t0)
    return records, RunTiming(t0, _span(records), stopped_by)


async def _closed_loop(shape: LoadShape, tracked, t0: float) -> str:
    deadline = t0 + shape.duration_s
    next_i = 0
    stopped_by = "count"

    async def worker() -> None:
        nonlocal next_i, stopped_by
        while next_i < shape.max_requests:
            if time.perf_counter() >= deadline:
                stopped_by = "time"
                return
            i, next_i = next_i, next_i + 1
            await tracked(i)

    n_workers = max(1, int(shape.value))
    await _bounded(asyncio.gather(*(worker() for _ in range(n_workers))), deadline + shape.grace_s)
    return stopped_by


async def _sessions_loop(shape: LoadShape, tracked, t0: float, sessions: list[list[int]]) -> str:
    deadline = t0 + shape.duration_s
    queue = list(reversed(sessions))
    sent = 0
    stopped_by = "count"

    async def user() -> None:
        nonlocal sent, stopped_by
        while queue:
            for i in queue.pop():
                if sent >= shape.max_requests:
                    return
                if time.perf_counter() >= deadline:
                    stopped_by = "time"
                    return
                sent += 1
                await tracked(i)

    await _bounded(asyncio.gather(*(user() for _ in range(max(1, int(shape.value))))), deadline + shape.grace_s)
    return stopped_by


async def _open_loop(shape: LoadShape, tracked, t0: float) -> str:
    gaps = poisson_gaps(shape.value, shape.max_requests, shape.seed)
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    tasks: list[asyncio.Task] = []
    deadline = t0 + shape.duration_s
    stopped_by = "count"

    async def one(i: int) -> None:
        if limit is None:
            await tracked(i)
        else:
            async with limit:
                await tracked(i)

    due = t0
    for i, gap in enumerate(gaps):
        due += gap
        if due >= deadline:
            stopped_by = "time"
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))  # scheduled times, not gaps: no drift
        tasks.append(asyncio.create_task(one(i)))
    if tasks:
        await _bounded(asyncio.gather(*tasks), max(deadline, time.perf_counter()) + shape.grace_s)
    return stopped_by


async def _bounded(aw, until_perf: float) -> None:
    """Await ``aw`` until ``until_perf``; then cancel what is still running."""
    fut = asyncio.ensure_future(aw)
    try:
        await asyncio.wait_for(asyncio.shield(fut), max(0.0, until_perf - time.perf_counter()))
    except TimeoutError:
        fut.cancel()
        await asyncio.gather(fut, return_exceptions=True)


def _span(records: list[RequestRecord]) -> float:
    """Seconds from the first send to the last completion (throughput's denominator)."""
    if not records:
        return 0.0
    first = min(r.start_s for r in records)
    last = max(r.start_s + (r.e2e_ms or 0.0) / 1000 for r in records)
    return max(last - first, 1e-9)
