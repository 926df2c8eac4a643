"""The fleet view's arithmetic: quantiles as PromQL's ``histogram_quantile`` computes them,
reset-aware differences, and a snapshot built from two processes' scrapes."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.fleetview import promstats as ps
from services.fleetview.snapshot import ProcessRow, build


@pytest.mark.parametrize("q, expected", [
    (0.25, 0.05),  # rank 2.5 of 5 in (0, 0.1]: linear inside the bucket
    (0.5, 0.1),  # rank 5 ends the first bucket exactly
    (0.9, 0.1 + 0.4 * 4 / 5),  # rank 9: 4 of the 5 observations in (0.1, 0.5]
])
def test_quantile_interpolates_like_histogram_quantile(q, expected):
    cum = [(0.1, 5.0), (0.5, 10.0), (math.inf, 10.0)]
    assert ps.quantile(q, cum) == pytest.approx(expected)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    assert ps.quantile(0.99, [(0.1, 5.0), (0.5, 10.0), (math.inf, 20.0)]) == 0.5


def test_quantile_of_nothing_is_none():
    assert ps.quantile(0.5, []) is None
    assert ps.quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_delta_takes_a_restarted_counter_from_zero_and_gauges_as_they_are():
    old = {("c_total", ()): 10.0, ("g", ()): 5.0}
    new = {("c_total", ()): 4.0, ("g", ()): 2.0, ("d_total", ()): 1.0}
    assert ps.delta(new, old, {"g"}) == {("c_total", ()): 4.0, ("g", ()): 2.0, ("d_total", ()): 1.0}
    assert ps.delta({("c_total", ()): 12.0}, old, set())[("c_total", ())] == 2.0


def _scrape(records: int, lag: int, partition: str, seconds: list[float]) -> tuple[ps.Samples, set[str]]:
    """A real exposition of the fleet's series names (own registry), parsed back."""
    reg = CollectorRegistry()
    Counter("mmfleet_stage_records", "", ["stage", "outcome"], registry=reg).labels("decode", "ok").inc(records)
    Gauge("mmfleet_consumer_lag_records", "", ["stage", "partition"], registry=reg).labels("decode", partition).set(lag)
    h = Histogram("mmfleet_stage_compute_seconds", "", ["stage"], buckets=(0.1, 1.0), registry=reg)
    for s in seconds:
        h.labels("decode").observe(s)
    return ps.parse(generate_latest(reg).decode())


def test_snapshot_sums_processes():
    (a, gauges), (b, _) = _scrape(3, 2, "0", [0.05, 0.05]), _scrape(5, 7, "1", [0.5, 0.5])
    now: ps.Samples = {}
    for part in (a, b):
        ps.add_into(now, part)
    rows = [ProcessRow(f"decode-{i}", "worker", ("decode",), "h", i, "", "up", 1.0, 0) for i in (1, 2)]
    rows.append(ProcessRow("decode-3", "worker", ("decode",), "h", 3, "", "gone", 1.0, 0))
    snap = build(taken_unix_ms=0, window_s=30, rate_window_s=10, processes=rows, now=now, window=now, per_s={},
                 pool_bytes=1024, problems=[])
    (decode,) = snap.stages
    assert (decode.workers_up, decode.workers_down) == (2, 1)
    assert decode.records_total == 8 and decode.outcomes == {"ok": 8}
    assert decode.records_per_s is None  # no second scrape yet
    assert decode.lag == {"0": 2, "1": 7} and decode.lag_total == 9
    assert decode.compute.count == 4 and decode.compute.p50 == pytest.approx(0.1)
    assert decode.compute.p99 == pytest.approx(0.1 + 0.9 * (3.96 - 2) / 2)
    assert "mmfleet_consumer_lag_records" in gauges
