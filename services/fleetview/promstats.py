"""Arithmetic on scraped Prometheus samples: parse, subtract, sum across processes, quantiles.

A scrape is ``Samples``: {(sample name, sorted label pairs): value}, parsed with
``prometheus_client.parser``. Counters and histograms are differenced between two scrapes of one
process (a value below the older one means the process restarted: the counter is taken from
zero, as Prometheus' ``rate()`` does); gauges are read as they are. Quantiles interpolate
linearly inside the bucket, as PromQL's ``histogram_quantile`` does.

Design: docs/guide/observability.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def parse(text: str) -> tuple[Samples, set[str]]:
    """(samples, names of the gauge families) of one ``/metrics`` body."""
    samples: Samples = {}
    gauges: set[str] = set()
    for fam in text_string_to_metric_families(text):
        if fam.type == "gauge":
            gauges.add(fam.name)
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, gauges


def delta(new: Samples, old: Samples, gauges: set[str]) -> Samples:
    """Counters/histograms: ``new - old`` (reset-aware); gauges: ``new``."""
    out: Samples = {}
    for key, value in new.items():
        if key[0] in gauges:
            out[key] = value
            continue
        before = old.get(key, 0.0)
        out[key] = value - before if value >= before else value
    return out


def add_into(total: Samples, part: Mapping[tuple[str, Labels], float], scale: float = 1.0) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value * scale


def _matches(labels: Labels, want: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in want.items())


def total(samples: Samples, name: str, **want: str) -> float:
    """Sum of ``name`` over samples whose labels include ``want`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and _matches(ls, want))


def has(samples: Samples, name: str, **want: str) -> bool:
    return any(n == name and _matches(ls, want) for (n, ls) in samples)


def by_label(samples: Samples, name: str, label: str, **want: str) -> dict[str, float]:
    """``name`` summed per value of ``label`` (samples lacking it are left out)."""
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name and _matches(ls, want):
            key = dict(ls).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
    return out


def buckets(samples: Samples, family: str, **want: str) -> list[tuple[float, float]]:
    """Cumulative ``(upper bound, count)`` of histogram ``family``, summed over matching series."""
    per_le = by_label(samples, family + "_bucket", "le", **want)
    return sorted((float(le), count) for le, count in per_le.items())


def quantile(q: float, cumulative: Iterable[tuple[float, float]]) -> float | None:
    """``histogram_quantile(q, ...)``: None with no observations; the highest finite bound when
    the rank falls in the +Inf bucket."""
    cum = list(cumulative)
    if not cum or cum[-1][1] <= 0:
        return None
    rank = q * cum[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in cum:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def per_bucket(cumulative: list[tuple[float, float]]) -> list[float]:
    """Observations in each bucket alone (cumulative counts differenced)."""
    out, prev = [], 0.0
    for _, count in cumulative:
        out.append(max(count - prev, 0.0))
        prev = count
    return out
