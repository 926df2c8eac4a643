"""The reuse suite (``python -m loadtest reuse``, part of ``make bench``): the embedding cache
on vs off, and against ``vllm serve``, side by side in one run.

One image a request, from a pool of ``pool_size`` with probability ``reuse_ratio`` (each ratio
and repeat its own seed: pools start cold). Targets ``ON``, ``OFF``, ``VLLM``, ``VLLM_FLEET``
are started together and take turns (order rotating; the others SIGSTOPped), ``repeats`` times.
Adds ``reuse_vs_ratio.png`` and each run's encoder items. Goals: at 80 % reuse TTFT p50 with
the cache >= 60 % lower; at 0 % at most 3 % higher; at 80 % the fleet >= 1.3x ``vllm serve``'s
request rate, TTFT p50 >= 50 % lower. Medians over repeats. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
from contextlib import ExitStack
from dataclasses import replace

from loadtest import workloads
from loadtest.bench import BenchConfig, _run_target
from loadtest.interleave import Interleaved, warm_requests
from loadtest.loadgen import LoadShape
from loadtest.targets import TargetOptions

log = logging.getLogger("loadtest.reuse")

ON, OFF, VLLM = "fleet:e-p-d", "fleet:e-p-d,embedding_cache_bytes=0", "vllm-serve"
VLLM_FLEET = "fleet:e-p-d,engine=vllm"  # the cache on, vLLM as the engine (its own goal against vllm serve)
RATIOS = (0.0, 0.5, 0.8, 0.9)
GOAL_RATIO, GOAL_REDUCTION = 0.8, 0.60
GOAL_MISS_COST = 0.03  # at 0 % reuse, TTFT p50 with the cache at most this much higher
GOAL_VS_VLLM_RATE, GOAL_VS_VLLM_TTFT = 1.3, 0.50


def label(ratio: float, concurrency: int, repeat: int = 0) -> str:
    return f"reuse={ratio:.0%} c={concurrency}" + (f" #{repeat + 1}" if repeat else "")


def run_reuse(cfg: BenchConfig, opts: TargetOptions, ratios=RATIOS, repeats: int = 1) -> dict:
    """Every target started together, then every ratio on each in turn, ``repeats`` times (the
    order rotating), so drift in the machine's other load hits every side alike. ``cfg.shapes``
    must be one shape."""
    [shape] = cfg.shapes
    result: dict = {"config": {**cfg.to_dict(), "reuse_ratios": list(ratios), "repeats": repeats},
                    "runs": [], "skipped": {},
                    "failed": {}, "targets": {}, "load_average_1m": {"start": os.getloadavg()[0]}}
    warm = warm_requests(cfg)
    with ExitStack() as stack:
        side = Interleaved(stack, cfg, opts, result, warm)
        side.open_all()
        for rep in range(repeats):
            for k, ratio in enumerate(ratios):
                # a seed per (ratio, repeat): every run's pool starts cold
                wl = replace(cfg.workload, reuse_ratio=ratio, seed=cfg.workload.seed + 1000 * rep + k + 1)
                for spec, _ep in side.rotated(k + rep):
                    with side.running(spec) as ep:
                        _one_run(result, ep, cfg, wl, ratio, rep, int(shape.value), warm)
    result["load_average_1m"]["end"] = os.getloadavg()[0]
    return result


def _one_run(result: dict, ep, cfg: BenchConfig, wl, ratio: float, rep: int, concurrency: int, warm) -> None:
    # resumed from a pause: its consumers may rejoin their groups first; the warm-up requests
    # (unrecorded, before the encoder count is read) wait that out
    asyncio.run(_run_target(ep, replace(cfg, shapes=[]), [], warm, None))
    before = _encoded(ep)
    [run] = asyncio.run(_run_target(ep, cfg, [workloads.build(wl)], [], None))
    after = _encoded(ep)
    run["label"] = label(ratio, concurrency, rep)
    run["reuse_ratio"] = ratio
    run["repeat"] = rep
    run["encoder_items"] = None if before is None or after is None else after - before
    run["load_average_1m"] = os.getloadavg()[0]
    result["runs"].append(run)


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


def _value(run: dict, what: str) -> float | None:
    if what in ("output_throughput", "request_throughput"):
        return run["aggregates"][what]
    metric, stat = what.rsplit(":", 1)
    return _p(run, metric, stat)


def _over(runs: list[dict], what: str) -> tuple[float, float, float] | None:
    """(median, min, max) of ``what`` over repeats ("ttft_ms:p50", "request_throughput", ...)."""
    vals = [v for v in (_value(r, what) for r in runs if r["aggregates"]["ok"]) if v is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _m(x) -> float | None:
    return None if x is None else x[0]


def _fr(x) -> str:
    """median (min–max), or the value alone for one repeat"""
    if x is None:
        return "–"
    return f"{x[0]:.1f}" if x[1] == x[2] else f"{x[0]:.1f} ({x[1]:.0f}–{x[2]:.0f})"


def _vs_vllm(fleet: str, vllm: str, ratio: float, runs: list[dict], vruns: list[dict]) -> dict | None:
    p50a, p50v = _over(runs, "ttft_ms:p50"), _over(vruns, "ttft_ms:p50")
    ra, rv = _over(runs, "request_throughput"), _over(vruns, "request_throughput")
    if not (_m(p50v) and _m(rv) and _m(p50a) and _m(ra)):
        return None
    rate, lower = ra[0] / rv[0], 1 - p50a[0] / p50v[0]
    name = "vllm serve" if vllm == VLLM else vllm
    return {"goal": f"`{fleet}` ≥ {GOAL_VS_VLLM_RATE}× `{name}`'s request rate and ≥ "
                    f"{GOAL_VS_VLLM_TTFT:.0%} lower TTFT p50 at {ratio:.0%} reuse",
            "measured": f"{ra[0]:.2f} vs {rv[0]:.2f} req/s = {rate:.2f}×; TTFT p50 "
                        f"{p50a[0]:.1f} vs {p50v[0]:.1f} ms = {lower:.0%} lower",
            "verdict": "met" if rate >= GOAL_VS_VLLM_RATE and lower >= GOAL_VS_VLLM_TTFT else "**not met**"}


def table(result: dict, on: str = ON, off: str = OFF, vllm: str = VLLM,
          vfleet: str | None = None) -> tuple[list[dict], list[str]]:
    """Goal rows and a markdown table (per ratio: TTFT p50/p99, request rate and throughput of
    every target, medians over repeats with their range); ``vfleet``, a fourth target (the
    fleet with the vLLM engine), gets its own rows and its own goal against ``vllm``."""
    ratios = result["config"]["reuse_ratios"]
    group: dict = {}
    for r in result["runs"]:
        group.setdefault((r["target"], r["reuse_ratio"]), []).append(r)
    has_vllm = any(t == vllm for t, _ in group)
    reps = result["config"].get("repeats", 1)
    lines = ["## Embedding cache on vs off" + (" vs `vllm serve`" if has_vllm else ""), "",
             f"`{on}` vs `{off}`" + (f" vs `{vllm}`" if has_vllm else "") +
             (f"; median (min–max) over {reps} repeats" if reps > 1 else ""), "",
             "| reuse | TTFT p50 on / off" + (" / vllm" if has_vllm else "") + " (ms) | TTFT p50 on vs off | "
             "TTFT p99 on / off (ms) | req/s on / off" + (" / vllm" if has_vllm else "") +
             " | encoder items on | errors on / off |",
             "|---|---|---|---|---|---|---|"]
    goals = []
    for ratio in ratios:
        a, b, v = group.get((on, ratio), []), group.get((off, ratio), []), group.get((vllm, ratio), [])
        p50a, p50b, p50v = _over(a, "ttft_ms:p50"), _over(b, "ttft_ms:p50"), _over(v, "ttft_ms:p50")
        ra, rb, rv = _over(a, "request_throughput"), _over(b, "request_throughput"), _over(v, "request_throughput")
        change = None if not (_m(p50a) and _m(p50b)) else 1 - p50a[0] / p50b[0]
        items = [r.get("encoder_items") for r in a]
        lines.append(
            f"| {ratio:.0%} | {_fr(p50a)} / {_fr(p50b)}" + (f" / {_fr(p50v)}" if has_vllm else "") +
            f" | {'–' if change is None else f'{-change:+.0%}'} | "
            f"{_fr(_over(a, 'ttft_ms:p99'))} / {_fr(_over(b, 'ttft_ms:p99'))} | "
            f"{_f(_m(ra))} / {_f(_m(rb))}" + (f" / {_f(_m(rv))}" if has_vllm else "") + " | "
            f"{'–' if not a or None in items else sum(items)} of {sum(r['aggregates']['requests'] for r in a)} | "
            f"{sum(r['aggregates']['failed'] for r in a)} / {sum(r['aggregates']['failed'] for r in b)} |")
        measured = "–" if change is None else f"{_f(_m(p50a))} vs {_f(_m(p50b))} ms = {change:.0%} lower"
        missing = "not evaluated: a side did not run"
        if abs(ratio - GOAL_RATIO) < 1e-9:
            goals.append({"goal": f"TTFT p50 with the cache ≥ {GOAL_REDUCTION:.0%} lower than without "
                                  f"at {ratio:.0%} reuse",
                          "measured": measured, "verdict": missing if change is None else
                          ("met" if change >= GOAL_REDUCTION else "**not met**")})
            for fleet in (on, vfleet) if vfleet else (on,):
                row = _vs_vllm(fleet, vllm, ratio, group.get((fleet, ratio), []), v)
                if row is not None:
                    goals.append(row)
            if not any(g["goal"].startswith(f"`{on}` ≥") for g in goals) and (
                    has_vllm or vllm in result.get("skipped", {})):
                why = result.get("skipped", {}).get(vllm, "no run")
                goals.append({"goal": f"`{on}` vs `vllm serve` at {ratio:.0%} reuse", "measured": "–",
                              "verdict": f"not evaluated: {why.splitlines()[0][:160]}"})
        if ratio == 0:
            goals.append({"goal": f"TTFT p50 with the cache ≤ {GOAL_MISS_COST:.0%} higher than without at 0 % reuse "
                                  "(the miss path's cost)",
                          "measured": "–" if change is None else f"{_f(_m(p50a))} vs {_f(_m(p50b))} ms = "
                                                                 f"{-change:+.1%}",
                          "verdict": missing if change is None else ("met" if -change <= GOAL_MISS_COST
                                                                     else "**not met**")})
    if vfleet and any(t == vfleet for t, _ in group):
        lines += ["", f"`{vfleet}` (the cache on, vLLM as the engine):", "",
                  "| reuse | TTFT p50 (ms) | TTFT p99 (ms) | req/s | errors |", "|---|---|---|---|---|"]
        for ratio in ratios:
            runs = group.get((vfleet, ratio), [])
            lines.append(f"| {ratio:.0%} | {_fr(_over(runs, 'ttft_ms:p50'))} | {_fr(_over(runs, 'ttft_ms:p99'))} | "
                         f"{_f(_m(_over(runs, 'request_throughput')))} | "
                         f"{sum(r['aggregates']['failed'] for r in runs)} |")
    return goals, lines


def _f(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def plot(result: dict, out_dir, on: str = ON, off: str = OFF, vllm: str = VLLM) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for target, name in ((on, "cache on"), (off, "cache off"), (vllm, "vllm serve")):
        ratios = sorted({r["reuse_ratio"] for r in result["runs"] if r["target"] == target})
        runs = {x: [r for r in result["runs"] if r["target"] == target and r["reuse_ratio"] == x] for x in ratios}
        xs = [100 * x for x in ratios]
        for ax, what in zip(axes, ("ttft_ms:p50", "ttft_ms:p99", "output_throughput"), strict=True):
            ax.plot(xs, [_m(_over(runs[x], what)) or float("nan") for x in ratios], marker="o", label=name)
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
    """One 448² image + 32 words per request: the shape the bench model's split is measured on."""
    return workloads.WorkloadConfig(kind="reuse", num_requests=n_requests, seed=0, max_tokens=(16, 16),
                                    text_words=(32, 32), images=(1, 1), resolutions=((448, 448),),
                                    pool_size=pool_size)


def default_shape(concurrency: int, n_requests: int, duration_s: float) -> LoadShape:
    return LoadShape("concurrency", concurrency, n_requests, duration_s=duration_s, grace_s=60)
