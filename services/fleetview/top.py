"""``mmfleet top``: the ``/fleet`` page in a terminal, drawn with ``rich`` from the same
:class:`~services.fleetview.snapshot.FleetSnapshot` (collected here, straight from Redis and
each process's ``/metrics``: no gateway needed). Refreshes every ``interval_s`` until Ctrl-C;
``--once`` prints one frame (quantiles over each process's life; rates need two frames).

Design: docs/guide/observability.md.
"""

from __future__ import annotations

import asyncio

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.fleetview.collect import FleetCollector
from services.fleetview.snapshot import FleetSnapshot, HistogramView, Quantiles
from shared.keys import RedisKeys
from shared.settings import Settings
from shared.transport.redis_conn import make_redis

_STATE_STYLE = {"up": "green", "down": "yellow", "gone": "red"}


def _secs(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:.1f}ms" if s < 1 else f"{s:.2f}s"


def _q3(q: Quantiles) -> str:
    return "/".join(_secs(x) for x in (q.p50, q.p90, q.p99)) if q.count else "–"


def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _bytes(b: float | None) -> str:
    if b is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    raise AssertionError


def _pct(r: float | None) -> str:
    return "–" if r is None else f"{r * 100:.1f}%"


def _pairs(d: dict[str, float], fmt=lambda v: f"{v:,.0f}") -> str:
    return "  ".join(f"{k}:{fmt(v)}" for k, v in d.items()) or "–"


def _hist_line(h: HistogramView) -> str:
    bars = " ▁▂▃▄▅▆▇█"
    peak = max(h.counts, default=0) or 1
    spark = "".join(bars[round(8 * c / peak)] for c in h.counts)
    return f"{spark}  n={h.quantiles.count:,.0f}  p50/p90/p99 {_q3(h.quantiles)}"


def render(snap: FleetSnapshot) -> Group:
    """One frame: stages, fleet-wide figures, processes."""
    stages = Table(title="stages", title_justify="left", expand=True)
    for col in ("stage", "workers", "records", "rec/s", "lag by partition", "queue p50/p90/p99",
                "transfer p50/p90/p99", "compute p50/p90/p99"):
        stages.add_column(col, no_wrap=col != "lag by partition")
    for s in snap.stages:
        lag = " ".join(f"p{p}:{n:.0f}" for p, n in s.lag.items()) or "–"
        workers = f"{s.workers_up}" + (f" (+{s.workers_down} down)" if s.workers_down else "")
        stages.add_row(s.stage, workers, _num(s.records_total, 0), _num(s.records_per_s, 2), lag,
                       _q3(s.queue_wait), _q3(s.transfer), _q3(s.compute))

    g, c, r, n = snap.gateway, snap.cache, snap.routing, snap.nixl
    fleet = Table.grid(padding=(0, 2))
    fleet.add_column(style="dim")
    fleet.add_column()
    fleet.add_row("requests", f"{_num(g.requests_per_s, 2)}/s  in flight {g.inflight:.0f}  "
                              f"by status {_pairs(g.requests_by_status)}  429s {_pairs(g.rejections)}")
    fleet.add_row("TTFT", _hist_line(g.ttft))
    fleet.add_row("ITL", _hist_line(g.itl))
    fleet.add_row("end to end", _q3(g.e2e))
    fleet.add_row("embedding cache", f"hit rate {_pct(c.hit_rate)} ({c.hits:.0f} hits, {c.misses:.0f} misses)  "
                                     f"held {_pairs(c.pool_bytes, _bytes)}  encoder items {c.encoder_items_total:.0f}")
    fleet.add_row("KV routing", f"hit rate {_pct(r.kv_hit_rate)}  {_pairs(r.decisions)}  "
                                f"prefix blocks {_pct(r.prefix_hit_rate)}")
    fleet.add_row("NIXL", f"in {_bytes(n.in_bytes_per_s)}/s  out {_bytes(n.out_bytes_per_s)}/s  "
                          f"pool {_bytes(n.pool_used_bytes)} of {_bytes(n.pool_capacity_bytes)}  "
                          f"pull {_q3(n.transfer)}")

    procs = Table(title="processes", title_justify="left", expand=True)
    for col in ("process", "stages", "state", "host", "pid", "pool in use", "note"):
        procs.add_column(col, no_wrap=col != "note")
    for p in snap.processes:
        procs.add_row(p.id, "gateway" if p.kind == "gateway" else ",".join(p.stages),
                      Text(p.state, style=_STATE_STYLE.get(p.state, "")), p.host, str(p.pid),
                      _bytes(p.pool_used_bytes), p.error)
    up = sum(p.state == "up" for p in snap.processes)
    head = Text(f"mmfleet top · {up} of {len(snap.processes)} processes up · window {snap.window_s:.0f} s",
                style="bold")
    problems = [Text(p, style="red") for p in snap.problems]
    return Group(head, *problems, stages, fleet, procs)


async def run_top(settings: Settings, *, once: bool, interval_s: float, console: Console | None = None) -> int:
    console = console or Console()
    redis = make_redis(settings)
    collector = FleetCollector(redis, RedisKeys(settings.redis_prefix), pool_bytes=settings.pool_bytes,
                               min_interval_s=0.0)
    try:
        if once:
            console.print(render(await collector.snapshot()))
            return 0
        with Live(render(await collector.snapshot()), console=console, screen=False, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval_s)
                live.update(render(await collector.snapshot()), refresh=True)
    finally:
        await collector.close()
        await redis.aclose()
