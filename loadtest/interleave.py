"""Targets up side by side, measured one at a time: :class:`Interleaved` starts every target
of a suite (each with its own broker and Redis: stage topics and consumer groups are
fleet-wide names), warms each up, then pauses it (SIGSTOP, its broker and Redis too) so that
only the target being measured takes the shared cores; ``running(spec)`` resumes one for a
measurement. A target that cannot start is recorded (skipped / failed) and the others go on.
Used by the reuse and sliding-window suites. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace

from loadtest import procs
from loadtest.bench import BenchConfig, _run_target
from loadtest.targets import Endpoint, TargetOptions, Targets, TargetSkipped

log = logging.getLogger("loadtest.interleave")


def warm_requests(cfg: BenchConfig) -> list:
    """The ``cfg.warmup`` requests each target answers first, unrecorded: the workload with another
    seed, so no target meets a run's content before it."""
    from loadtest import workloads

    return workloads.build(replace(cfg.workload, seed=cfg.workload.seed + 10_007,
                                   num_requests=max(1, cfg.warmup)))[:cfg.warmup]


class Interleaved:
    def __init__(self, stack: ExitStack, cfg: BenchConfig, opts: TargetOptions, result: dict, warm: list) -> None:
        """``result`` gets ``targets``, ``skipped`` and ``failed`` entries; ``warm``: the
        requests each target answers before it is first paused (unrecorded)."""
        self.eps: dict[str, Endpoint] = {}
        self._roots: dict[str, list[int]] = {}
        self._stack, self._cfg, self._opts, self._result, self._warm = stack, cfg, opts, result, warm

    def open_all(self) -> dict[str, Endpoint]:
        for i, spec in enumerate(self._cfg.targets):
            try:
                log_dir = self._opts.log_dir / f"target{i}"
                log_dir.mkdir(parents=True, exist_ok=True)
                targets = self._stack.enter_context(Targets(replace(self._opts, log_dir=log_dir)))
                ep = self.eps[spec] = self._stack.enter_context(targets.open(spec))
                self._result["targets"][spec] = {"base_url": ep.base_url, **ep.info}
                asyncio.run(_run_target(ep, replace(self._cfg, shapes=[]), [], self._warm, None))  # warm-up only
                self._roots[spec] = [*targets.infra_pids, *([ep.pid] if ep.pid else [])]
                # resumed before the target stops (ExitStack: last in, first out)
                self._stack.callback(procs.pause_trees, self._roots[spec], signal.SIGCONT)
                procs.pause_trees(self._roots[spec])
            except TargetSkipped as exc:
                self._result["skipped"][spec] = str(exc)
            except Exception as exc:  # noqa: BLE001 - the other targets' figures still count
                log.error("%s failed: %s", spec, exc)
                self._result["failed"][spec] = f"{type(exc).__name__}: {exc}"[:2000]
        return self.eps

    def rotated(self, shift: int) -> list[tuple[str, Endpoint]]:
        """The open targets, starting at ``shift`` (mod their number): each round another goes first."""
        items = list(self.eps.items())
        k = shift % len(items) if items else 0
        return items[k:] + items[:k]

    @contextmanager
    def running(self, spec: str) -> Iterator[Endpoint]:
        procs.pause_trees(self._roots.get(spec, []), signal.SIGCONT)
        try:
            yield self.eps[spec]
        finally:
            procs.pause_trees(self._roots.get(spec, []))
