"""Autoscaling policy (pure): how many workers a stage group should have, from the signals the
KEDA ScaledObjects of deploy/k8s use: ``ceil(lag / lag_per_worker)`` clamped to [min, max], one
more for a prefill / decode group while the fleet's TTFT p99 is above the SLO, up at once, down
one worker at a time after ``scale_down_after_s`` (:meth:`GroupScaler.decide`). No I/O here:
:mod:`services.autoscale` reads the signals and starts / stops the workers.

Design: docs/deploy/autoscaling.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.settings import Settings

TTFT_STAGES = frozenset({"prefill", "decode"})


@dataclass(frozen=True)
class Bounds:
    min_workers: int
    max_workers: int
    lag_per_worker: int
    ttft_slo_s: float
    scale_down_after_s: float

    @classmethod
    def from_settings(cls, s: Settings) -> Bounds:
        if not 1 <= s.autoscale_min_workers <= s.autoscale_max_workers:
            raise ValueError("need 1 <= autoscale_min_workers <= autoscale_max_workers")
        if s.autoscale_lag_per_worker < 1:
            raise ValueError("autoscale_lag_per_worker must be >= 1")
        return cls(s.autoscale_min_workers, s.autoscale_max_workers, s.autoscale_lag_per_worker,
                   s.autoscale_ttft_slo_ms / 1000, s.autoscale_scale_down_after_s)


@dataclass
class GroupScaler:
    """The decision for one stage group; keeps only the start of its current "wants fewer" run."""

    stages: tuple[str, ...]
    bounds: Bounds
    _below_since: float | None = field(default=None, repr=False)

    def decide(self, current: int, lag: int, ttft_p99_s: float | None, now_s: float) -> tuple[int, str]:
        """(target worker count, why). ``ttft_p99_s`` None: no requests seen in the window.

        A prefill / decode group gets one more worker than it has while TTFT p99 is above the SLO
        and more records are unfinished than it has workers (the lag alone can look small while
        each record is slow; with no more records than workers, one more would sit idle). Down
        only after ``wanted < current`` held for ``scale_down_after_s`` without a break, then by
        one worker, and the wait starts over: a burst's tail or a noisy p99 never makes it flap."""
        b = self.bounds
        wanted = math.ceil(max(lag, 0) / b.lag_per_worker)
        why = f"lag {lag}"
        slow = ttft_p99_s is not None and ttft_p99_s > b.ttft_slo_s
        if slow and lag > current and TTFT_STAGES & set(self.stages):
            wanted = max(wanted, current + 1)
            why += f", TTFT p99 {ttft_p99_s:.2f} s > SLO {b.ttft_slo_s:.2f} s"
        wanted = min(max(wanted, b.min_workers), b.max_workers)
        if wanted >= current:
            self._below_since = None
            return wanted, why
        if self._below_since is None:
            self._below_since = now_s
        if now_s - self._below_since >= b.scale_down_after_s:
            self._below_since = now_s  # one worker per window
            return current - 1, why + f", wanted {wanted} for {b.scale_down_after_s:.0f} s"
        return current, why


def p99_from_buckets(deltas: list[tuple[float, float]]) -> float | None:
    """p99 upper bound from cumulative histogram bucket counts ``[(le, count)]`` of a window
    (sorted by ``le``); None when the window saw nothing."""
    if not deltas or deltas[-1][1] <= 0:
        return None
    need = 0.99 * deltas[-1][1]
    for le, count in deltas:
        if count >= need:
            return le
    return deltas[-1][0]
