"""The reuse suite (``python -m loadtest reuse``, part of ``make bench``): the embedding cache
on vs off, side by side in one run.

Workload ``reuse``: each request carries one image; with probability ``reuse_ratio`` it is one
of a pool of ``pool_size`` images, else an image seen nowhere else. Each ratio (default 0, 50,
80, 90 %) uses its own seed, so its pool starts cold in every fleet. Targets (default):
``fleet:e-p-d`` (cache on, the default settings) and ``fleet:e-p-d,embedding_cache_bytes=0``
(off); both are started together (a broker and Redis each) and run every ratio at one
concurrency, taking turns. Written like every
benchmark (runs/*.json, index.json, CDF plots, summary.md) plus ``reuse_vs_ratio.png`` (TTFT
p50 / p99 and throughput against the reuse ratio) and, per fleet run, the encoder items it
cost (the fleet-wide counter ``RedisKeys.encoder_items``; the cache-off path does not count
there). Goal: at 80 % reuse, TTFT p50 with the cache ≥ 40 % lower than without.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import ExitStack
from dataclasses import replace

from loadtest import workloads
from loadtest.bench import BenchConfig, _run_target
from loadtest.loadgen import LoadShape
from loadtest.targets import TargetOptions, Targets, TargetSkipped

log = logging.getLogger("loadtest.reuse")

ON, OFF = "fleet:e-p-d", "fleet:e-p-d,embedding_cache_bytes=0"
RATIOS = (0.0, 0.5, 0.8, 0.9)
GOAL_RATIO, GOAL_REDUCTION = 0.8, 0.40


def label(ratio: float, concurrency: int) -> str:
    return f"reuse={ratio:.0%} c={concurrency}"


def run_reuse(cfg: BenchConfig, opts: TargetOptions, ratios=RATIOS) -> dict:
    """Both targets started together, then every ratio on each in turn (the order alternating
    per ratio), so drift in the machine's other load hits both sides alike. ``cfg.shapes``
    must be one shape."""
    [shape] = cfg.shapes
    result: dict = {"config": {**cfg.to_dict(), "reuse_ratios": list(ratios)}, "runs": [], "skipped": {},
                    "failed": {}, "targets": {}, "load_average_1m": {"start": os.getloadavg()[0]}}
    warm = workloads.build(replace(cfg.workload, seed=cfg.workload.seed + 10_007,
                                   num_requests=max(1, cfg.warmup)))[:cfg.warmup]
    with ExitStack() as stack:
        eps = {}
        for i, spec in enumerate(cfg.targets):
            try:
                # fleets up at once need a broker each: stage topics and consumer groups are
                # fleet-wide names (only Redis keys carry a prefix)
                log_dir = opts.log_dir / f"target{i}"
                log_dir.mkdir(parents=True, exist_ok=True)
                targets = stack.enter_context(Targets(replace(opts, log_dir=log_dir)))
                eps[spec] = stack.enter_context(targets.open(spec))
                result["targets"][spec] = {"base_url": eps[spec].base_url, **eps[spec].info}
                asyncio.run(_run_target(eps[spec], replace(cfg, shapes=[]), [], warm, None))  # warm-up only
            except TargetSkipped as exc:
                result["skipped"][spec] = str(exc)
            except Exception as exc:  # noqa: BLE001 - the other target's figures still count
                log.error("%s failed: %s", spec, exc)
                result["failed"][spec] = f"{type(exc).__name__}: {exc}"[:2000]
        for k, ratio in enumerate(ratios):
            wl = replace(cfg.workload, reuse_ratio=ratio, seed=cfg.workload.seed + k + 1)
            order = list(eps.items()) if k % 2 == 0 else list(reversed(eps.items()))
            for spec, ep in order:
                before = _encoded(ep)
                [run] = asyncio.run(_run_target(ep, cfg, workloads.build(wl), [], None))
                after = _encoded(ep)
                run["label"] = label(ratio, int(shape.value))
                run["reuse_ratio"] = ratio
                run["encoder_items"] = None if before is None or after is None else after - before
                run["load_average_1m"] = os.getloadavg()[0]
                result["runs"].append(run)
    result["load_average_1m"]["end"] = os.getloadavg()[0]
    return result


def _encoded(ep) -> int | None:
    if not (ep.redis_url and ep.redis_prefix):
        return None
    import redis

    from shared.keys import RedisKeys

    r = redis.Redis.from_url(ep.redis_url)
    try:
        return int(r.get(RedisKeys(ep.redis_prefix).encoder_items()) or 0)
    finally:
        r.close()


def _p(run: dict | None, metric: str, stat: str) -> float | None:
    return None if run is None else run["aggregates"].get(metric, {}).get(stat)


def table(result: dict, on: str = ON, off: str = OFF) -> tuple[list[dict], list[str]]:
    """Goal rows and a markdown table (per ratio: TTFT p50/p99 and throughput on vs off)."""
    runs = {(r["target"], r["reuse_ratio"]): r for r in result["runs"]}
    ratios = result["config"]["reuse_ratios"]
    lines = ["## Embedding cache on vs off", "",
             f"`{on}` vs `{off}`", "",
             "| reuse | TTFT p50 on / off (ms) | TTFT p50 change | TTFT p99 on / off (ms) | "
             "tok/s on / off | encoder items on | errors on / off |",
             "|---|---|---|---|---|---|---|"]
    goals = []
    for ratio in ratios:
        a, b = runs.get((on, ratio)), runs.get((off, ratio))
        p50a, p50b = _p(a, "ttft_ms", "p50"), _p(b, "ttft_ms", "p50")
        change = None if not (p50a and p50b) else 1 - p50a / p50b
        lines.append(
            f"| {ratio:.0%} | {_f(p50a)} / {_f(p50b)} | {'–' if change is None else f'{-change:+.0%}'} | "
            f"{_f(_p(a, 'ttft_ms', 'p99'))} / {_f(_p(b, 'ttft_ms', 'p99'))} | "
            f"{_f(a and a['aggregates']['output_throughput'])} / {_f(b and b['aggregates']['output_throughput'])} | "
            f"{'–' if not a or a.get('encoder_items') is None else a['encoder_items']} of "
            f"{'–' if not a else a['aggregates']['requests']} | "
            f"{'–' if not a else a['aggregates']['failed']} / {'–' if not b else b['aggregates']['failed']} |")
        if abs(ratio - GOAL_RATIO) < 1e-9:
            goal = f"TTFT p50 with the cache ≥ {GOAL_REDUCTION:.0%} lower than without at {ratio:.0%} reuse"
            goals.append({"goal": goal, "measured": "–" if change is None else
                          f"{_f(p50a)} vs {_f(p50b)} ms = {change:.0%} lower",
                          "verdict": "not evaluated: a side did not run" if change is None else
                          ("met" if change >= GOAL_REDUCTION else "**not met**")})
    return goals, lines


def _f(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def plot(result: dict, out_dir, on: str = ON, off: str = OFF) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for target, name in ((on, "cache on"), (off, "cache off")):
        rs = sorted((r for r in result["runs"] if r["target"] == target), key=lambda r: r["reuse_ratio"])
        xs = [100 * r["reuse_ratio"] for r in rs]
        for ax, (metric, stat) in zip(axes[:2], (("ttft_ms", "p50"), ("ttft_ms", "p99")), strict=True):
            ax.plot(xs, [_p(r, metric, stat) or float("nan") for r in rs], marker="o", label=name)
        axes[2].plot(xs, [r["aggregates"]["output_throughput"] for r in rs], marker="o", label=name)
    for ax, title, unit in zip(axes, ("TTFT p50", "TTFT p99", "output throughput"), ("ms", "ms", "tokens/s"),
                               strict=True):
        ax.set(title=f"{title} vs image reuse", xlabel="reuse ratio (%)", ylabel=unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "reuse_vs_ratio.png", dpi=110)
    plt.close(fig)
    return "reuse_vs_ratio.png"


def default_workload(n_requests: int, pool_size: int) -> workloads.WorkloadConfig:
    return workloads.WorkloadConfig(kind="reuse", num_requests=n_requests, seed=0, max_tokens=(16, 16),
                                    text_words=(8, 16), images=(1, 1), resolutions=((224, 224), (448, 336)),
                                    pool_size=pool_size)


def default_shape(concurrency: int, n_requests: int, duration_s: float) -> LoadShape:
    return LoadShape("concurrency", concurrency, n_requests, duration_s=duration_s, grace_s=60)
