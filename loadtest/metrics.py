"""Aggregates over one run's request records (ms; per second of first send → last completion).

- ``ttft_ms``, ``tpot_ms``, ``e2e_ms``: one value per ok request; ``itl_ms``: every gap pooled
  (as vLLM's bench); each ``{n, mean, p50, p90, p99}`` (linear interpolation) or ``n: 0``;
- ``request_throughput``, ``output_throughput`` (ok requests); ``errors`` by status ("0": no
  response);
- ``goodput``: ok requests meeting every SLO (``ttft_ms``, ``tpot_ms``, ``e2e_ms``, ``itl_ms`` as
  the worst gap; a request with no value for a metric meets it), as a count and per second.
Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from loadtest.client import RequestRecord

SLO_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")


def percentile(values: Sequence[float], p: float) -> float:
    """``p`` in [0, 100], linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Iterable[float]) -> dict:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99)}


def parse_slo(text: str) -> tuple[str, float]:
    """``"ttft_ms=200"`` → ("ttft_ms", 200.0)."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or name not in SLO_METRICS:
        raise ValueError(f"bad SLO {text!r}; expected NAME=MS with NAME one of {', '.join(SLO_METRICS)}")
    return name, float(value)


def meets(rec: RequestRecord, slos: dict[str, float]) -> bool:
    if not rec.ok:
        return False
    for name, limit in slos.items():
        value = max(rec.itl_ms, default=None) if name == "itl_ms" else getattr(rec, name)
        if value is not None and value > limit:
            return False
    return True


def aggregate(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    slos = slos or {}
    ok = [r for r in records if r.ok]
    span = max(duration_s, 1e-9)
    good = sum(1 for r in ok if meets(r, slos))
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(Counter(str(r.status) for r in records if not r.ok).items())),
        "duration_s": duration_s,
        "ttft_ms": summarize(r.ttft_ms for r in ok),
        "tpot_ms": summarize(r.tpot_ms for r in ok),
        "itl_ms": summarize(g for r in ok for g in r.itl_ms),
        "e2e_ms": summarize(r.e2e_ms for r in ok),
        "output_tokens": out_tokens,
        "output_tokens_per_request": summarize(r.output_tokens for r in ok),
        "request_throughput": len(ok) / span if records else 0.0,
        "output_throughput": out_tokens / span if records else 0.0,
        "goodput": {"slos": slos, "requests": good, "per_s": good / span if records else 0.0},
    }
