"""The fleet snapshot: one msgspec Struct that the ``/fleet`` page (as JSON) and ``mmfleet top``
both render, and :func:`build`, which computes it from three sums over every process's scrape.

- ``now``: the latest value of every series summed over processes (totals, gauges).
- ``window``: what happened in the last ``window_s`` (counters differenced per process against
  its oldest scrape in the window; its whole life on the first view). Quantiles and hit rates.
- ``per_s``: each process's counters differenced over the last ``rate_window_s``, divided by
  that process's own interval, summed. Empty on the first view (rates show as None).
Times are seconds; bytes are bytes. Design: docs/guide/observability.md.
"""

from __future__ import annotations

import msgspec

from services.fleetview import promstats as ps
from services.fleetview.promstats import Samples
from services.modes import STAGE_ORDER

QUANTILES = (0.5, 0.9, 0.99)


class Quantiles(msgspec.Struct, frozen=True):
    count: float  # observations in the window
    p50: float | None
    p90: float | None
    p99: float | None


class HistogramView(msgspec.Struct, frozen=True):
    bounds: list[str]  # each bucket's upper bound ("+Inf" last)
    counts: list[float]  # observations in each bucket alone, in the window
    quantiles: Quantiles


class ProcessRow(msgspec.Struct, frozen=True):
    id: str
    kind: str  # "worker" or "gateway"
    stages: tuple[str, ...]
    host: str
    pid: int
    metrics_url: str
    state: str  # "up" (scraped), "down" (liveness record, but /metrics unreachable), "gone" (no record)
    up_s: float  # since the process started
    last_seen_unix_ms: int  # last successful scrape
    pool_used_bytes: float | None = None
    error: str = ""


class StageRow(msgspec.Struct, frozen=True):
    stage: str
    workers_up: int
    workers_down: int
    records_total: float
    records_per_s: float | None
    outcomes: dict[str, float]  # lifetime, by outcome
    lag: dict[str, float]  # partition -> records behind
    lag_total: float
    queue_wait: Quantiles
    transfer: Quantiles
    compute: Quantiles


class GatewayView(msgspec.Struct, frozen=True):
    requests_by_status: dict[str, float]
    requests_per_s: float | None
    inflight: float
    rejections: dict[str, float]
    ttft: HistogramView
    itl: HistogramView
    e2e: Quantiles


class CacheView(msgspec.Struct, frozen=True):
    hits: float  # in the window
    misses: float
    hit_rate: float | None
    hits_by_source: dict[str, float]
    encoder_items_total: float
    pool_bytes: dict[str, float]  # cache -> bytes held now
    fallbacks_total: float


class RoutingView(msgspec.Struct, frozen=True):
    decisions: dict[str, float]  # reason -> count in the window
    kv_hit_rate: float | None  # kv_hit / every decision of the kv policy
    prefix_blocks_hit: float
    prefix_blocks_computed: float
    prefix_hit_rate: float | None


class NixlView(msgspec.Struct, frozen=True):
    in_bytes_per_s: float | None
    out_bytes_per_s: float | None
    in_bytes_total: float
    out_bytes_total: float
    pool_used_bytes: float
    pool_capacity_bytes: float  # pool_bytes x processes scraped (the viewer's setting)
    transfer: Quantiles


class FleetSnapshot(msgspec.Struct, frozen=True):
    taken_unix_ms: int
    window_s: float
    rate_window_s: float
    processes: list[ProcessRow]
    stages: list[StageRow]
    gateway: GatewayView
    cache: CacheView
    routing: RoutingView
    nixl: NixlView
    problems: list[str] = []  # e.g. Redis unreachable


def quantiles(samples: Samples, family: str, **want: str) -> Quantiles:
    cum = ps.buckets(samples, family, **want)
    count = cum[-1][1] if cum else 0.0
    return Quantiles(count, *(ps.quantile(q, cum) for q in QUANTILES))


def histogram(samples: Samples, family: str) -> HistogramView:
    cum = ps.buckets(samples, family)
    bounds = ["+Inf" if b == float("inf") else f"{b:g}" for b, _ in cum]
    return HistogramView(bounds, ps.per_bucket(cum), quantiles(samples, family))


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _rate(per_s: Samples, name: str, **want: str) -> float | None:
    return ps.total(per_s, name, **want) if per_s else None


def stage_rows(processes: list[ProcessRow], now: Samples, window: Samples, per_s: Samples) -> list[StageRow]:
    served = {s for p in processes if p.kind == "worker" for s in p.stages}
    labelled = set(ps.by_label(now, "mmfleet_stage_records_total", "stage"))
    rows = []
    for stage in [s for s in STAGE_ORDER if s in served | labelled]:
        workers = [p for p in processes if p.kind == "worker" and stage in p.stages]
        lag = ps.by_label(now, "mmfleet_consumer_lag_records", "partition", stage=stage)
        rows.append(StageRow(
            stage=stage,
            workers_up=sum(p.state == "up" for p in workers),
            workers_down=sum(p.state != "up" for p in workers),
            records_total=ps.total(now, "mmfleet_stage_records_total", stage=stage),
            records_per_s=_rate(per_s, "mmfleet_stage_records_total", stage=stage),
            outcomes=ps.by_label(now, "mmfleet_stage_records_total", "outcome", stage=stage),
            lag=dict(sorted(lag.items(), key=lambda kv: int(kv[0]))),
            lag_total=sum(lag.values()),
            queue_wait=quantiles(window, "mmfleet_stage_queue_wait_seconds", stage=stage),
            transfer=quantiles(window, "mmfleet_stage_transfer_seconds", stage=stage),
            compute=quantiles(window, "mmfleet_stage_compute_seconds", stage=stage)))
    return rows


def build(*, taken_unix_ms: int, window_s: float, rate_window_s: float, processes: list[ProcessRow],
          now: Samples, window: Samples, per_s: Samples, pool_bytes: int, problems: list[str]) -> FleetSnapshot:
    """The snapshot of the sums described in the module docstring."""
    hits = ps.total(window, "mmfleet_embedding_cache_hits_total")
    misses = ps.total(window, "mmfleet_embedding_cache_misses_total")
    decisions = ps.by_label(window, "mmfleet_routing_decisions_total", "reason")
    kv_decisions = ps.by_label(window, "mmfleet_routing_decisions_total", "reason", policy="kv")
    blocks_hit = ps.total(window, "mmfleet_prefix_blocks_hit_total")
    blocks_computed = ps.total(window, "mmfleet_prefix_blocks_computed_total")
    scraped = sum(p.state == "up" for p in processes)
    return FleetSnapshot(
        taken_unix_ms=taken_unix_ms, window_s=window_s, rate_window_s=rate_window_s, processes=processes,
        stages=stage_rows(processes, now, window, per_s),
        gateway=GatewayView(
            requests_by_status=dict(sorted(ps.by_label(now, "mmfleet_requests_total", "status").items())),
            requests_per_s=_rate(per_s, "mmfleet_requests_total"),
            inflight=ps.total(now, "mmfleet_inflight_requests"),
            rejections=ps.by_label(now, "mmfleet_admission_rejections_total", "reason"),
            ttft=histogram(window, "mmfleet_ttft_seconds"),
            itl=histogram(window, "mmfleet_itl_seconds"),
            e2e=quantiles(window, "mmfleet_e2e_seconds")),
        cache=CacheView(
            hits=hits, misses=misses, hit_rate=_ratio(hits, hits + misses),
            hits_by_source=ps.by_label(window, "mmfleet_embedding_cache_hits_total", "source"),
            encoder_items_total=ps.total(now, "mmfleet_encoder_items_total"),
            pool_bytes=ps.by_label(now, "mmfleet_embedding_pool_bytes", "cache"),
            fallbacks_total=ps.total(now, "mmfleet_embedding_cache_fallbacks_total")),
        routing=RoutingView(
            decisions=decisions, kv_hit_rate=_ratio(kv_decisions.get("kv_hit", 0.0), sum(kv_decisions.values())),
            prefix_blocks_hit=blocks_hit, prefix_blocks_computed=blocks_computed,
            prefix_hit_rate=_ratio(blocks_hit, blocks_hit + blocks_computed)),
        nixl=NixlView(
            in_bytes_per_s=_rate(per_s, "mmfleet_nixl_bytes_total", direction="in"),
            out_bytes_per_s=_rate(per_s, "mmfleet_nixl_bytes_total", direction="out"),
            in_bytes_total=ps.total(now, "mmfleet_nixl_bytes_total", direction="in"),
            out_bytes_total=ps.total(now, "mmfleet_nixl_bytes_total", direction="out"),
            pool_used_bytes=ps.total(now, "mmfleet_nixl_pool_used_bytes"),
            pool_capacity_bytes=float(pool_bytes * scraped),
            transfer=quantiles(window, "mmfleet_nixl_transfer_seconds")),
        problems=problems)
