"""Collect a :class:`~services.fleetview.snapshot.FleetSnapshot`: find every process through its
liveness record in Redis (``WorkerInfo`` / ``GatewayInfo``), scrape each ``/metrics`` at once
(bounded by ``scrape_timeout_s``), keep a short per-process history, and sum.

One collector per viewer process (the gateway's ``/fleet``, one ``mmfleet top``). Its memory
is bounded: ``window_s`` of scrapes per process, and a process whose record is gone stays
listed as ``gone`` for ``gone_keep_s`` (at most ``max_gone`` of them), so a worker that died
is shown, not silently dropped. Calls closer than ``min_interval_s`` share one collection, so
many open pages cost one scrape of the fleet per interval. Design: docs/guide/observability.md.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp
import msgspec
import redis.asyncio as aioredis

from services.fleetview import promstats as ps
from services.fleetview.snapshot import FleetSnapshot, ProcessRow, build
from services.modes import STAGE_ORDER
from shared.keys import RedisKeys
from shared.transport.liveness import live_gateways, live_workers

_LOOPBACK = "127.0.0.1"


@dataclass
class _Process:
    row: ProcessRow
    history: deque = field(default_factory=deque)  # (monotonic t, samples)
    gauges: set[str] = field(default_factory=set)
    gone_since: float | None = None


def metrics_url_of_worker(host: str, port: int) -> str:
    """A worker on this host is reached on loopback (its /metrics binds 127.0.0.1 by default);
    elsewhere by its host name (in compose, the container's name in Docker DNS)."""
    return f"http://{_LOOPBACK if host == socket.gethostname() else host}:{port}/metrics"


class FleetCollector:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, *, pool_bytes: int, window_s: float = 30.0,
                 rate_window_s: float = 10.0, min_interval_s: float = 1.0, scrape_timeout_s: float = 2.0,
                 gone_keep_s: float = 120.0, max_gone: int = 32, session: aiohttp.ClientSession | None = None):
        self._redis = redis
        self._keys = keys
        self._pool_bytes = pool_bytes
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self._min_interval_s = min_interval_s
        self._timeout = aiohttp.ClientTimeout(total=scrape_timeout_s)
        self._gone_keep_s = gone_keep_s
        self._max_gone = max_gone
        self._session = session
        self._own_session = session is None
        self._procs: dict[str, _Process] = {}
        self._last: tuple[float, FleetSnapshot] | None = None
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def snapshot(self) -> FleetSnapshot:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < self._min_interval_s:
                return self._last[1]
            snap = await self._collect()
            self._last = (time.monotonic(), snap)
            return snap

    # ------------------------------------------------------------------ one collection
    async def _collect(self) -> FleetSnapshot:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        problems: list[str] = []
        now_ms = int(time.time() * 1000)
        try:
            gateways, workers = await asyncio.gather(live_gateways(self._redis, self._keys),
                                                     live_workers(self._redis, self._keys))
        except (aioredis.RedisError, OSError) as exc:
            problems.append(f"Redis unreachable ({type(exc).__name__}): liveness records unknown")
            gateways, workers = None, None
        live: dict[str, ProcessRow] = {}
        for g in gateways or []:
            live[g.gateway_id] = ProcessRow(g.gateway_id, "gateway", (), g.host, g.pid, g.url.rstrip("/") + "/metrics",
                                            "up", (now_ms - g.started_unix_ms) / 1000, 0)
        for w in workers or []:
            url = metrics_url_of_worker(w.host, w.metrics_port) if w.metrics_port else ""
            live[w.worker_id] = ProcessRow(w.worker_id, "worker", tuple(w.stages), w.host, w.pid, url, "up",
                                           (now_ms - w.started_unix_ms) / 1000, 0)
        t = time.monotonic()
        results = await asyncio.gather(*(self._scrape(row.metrics_url) for row in live.values()))
        for row, (text, error) in zip(live.values(), results):
            proc = self._procs.get(row.id)
            if proc is None:
                proc = self._procs[row.id] = _Process(row)
            proc.gone_since = None
            if text is None:
                proc.row = _replace(row, state="down", error=error,
                                           last_seen_unix_ms=proc.row.last_seen_unix_ms)
                continue
            try:
                samples, gauges = ps.parse(text)
            except ValueError as exc:
                proc.row = _replace(row, state="down", error=f"unparsable /metrics: {exc}",
                                           last_seen_unix_ms=proc.row.last_seen_unix_ms)
                continue
            proc.history.append((t, samples))
            proc.gauges = gauges
            # keep the newest scrape that is at least window_s old: the window's baseline
            while len(proc.history) > 1 and t - proc.history[1][0] >= self.window_s:
                proc.history.popleft()
            if t - proc.history[0][0] > 2 * self.window_s:  # nobody looked for a while: stale
                proc.history.popleft()
            proc.row = _replace(row, last_seen_unix_ms=now_ms,
                                       pool_used_bytes=ps.total(samples, "mmfleet_nixl_pool_used_bytes")
                                       if ps.has(samples, "mmfleet_nixl_pool_used_bytes") else None)
        if gateways is not None:  # with Redis unreadable, nobody is declared gone
            self._mark_gone(set(live), t)
        return self._sum(now_ms, t, problems)

    async def _scrape(self, url: str) -> tuple[str | None, str]:
        if not url:
            return None, "no metrics port in its liveness record"
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None, f"/metrics answered {resp.status}"
                return await resp.text(), ""
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return None, f"/metrics unreachable: {type(exc).__name__}"

    def _mark_gone(self, live_ids: set[str], t: float) -> None:
        for pid, proc in list(self._procs.items()):
            if pid in live_ids:
                continue
            if proc.gone_since is None:
                proc.gone_since = t
                proc.history.clear()  # its counters leave the sums with it
                proc.row = _replace(proc.row, state="gone", error="liveness record expired or removed",
                                           pool_used_bytes=None)
            elif t - proc.gone_since > self._gone_keep_s:
                del self._procs[pid]
        gone = sorted((p for p in self._procs.values() if p.gone_since is not None), key=lambda p: p.gone_since)
        for proc in gone[:-self._max_gone] if len(gone) > self._max_gone else []:
            del self._procs[proc.row.id]

    def _sum(self, now_ms: int, t: float, problems: list[str]) -> FleetSnapshot:
        now: ps.Samples = {}
        window: ps.Samples = {}
        per_s: ps.Samples = {}
        for proc in self._procs.values():
            if proc.row.state != "up" or not proc.history:
                continue
            t_last, last = proc.history[-1]
            ps.add_into(now, last)
            t_first, first = proc.history[0]
            # until this viewer has watched for window_s, the window is the process's whole life
            ps.add_into(window, ps.delta(last, first if t_last - t_first >= self.window_s else {}, proc.gauges))
            base = next(((tb, s) for tb, s in proc.history if t_last - tb <= self.rate_window_s and tb < t_last),
                        None)
            if base is not None:
                ps.add_into(per_s, ps.delta(last, base[1], proc.gauges), 1.0 / (t_last - base[0]))
        order = {"gateway": 0, "worker": 1}
        rows = sorted((p.row for p in self._procs.values()),
                      key=lambda r: (order[r.kind], _stage_rank(r.stages), r.id))
        return build(taken_unix_ms=now_ms, window_s=self.window_s, rate_window_s=self.rate_window_s, processes=rows,
                     now=now, window=window, per_s=per_s, pool_bytes=self._pool_bytes, problems=problems)


def _stage_rank(stages: tuple[str, ...]) -> int:
    return min((STAGE_ORDER.index(s) for s in stages if s in STAGE_ORDER), default=len(STAGE_ORDER))


def _replace(row: ProcessRow, **changes) -> ProcessRow:
    return msgspec.structs.replace(row, **changes)
