"""One benchmark: a workload under one or more load shapes, against one or more targets.

Order: start the media server (http delivery) → per target: start it, warm it up (``warmup``
unrecorded requests, another seed), run each shape, read the fleet's per-stage spans, stop it →
write the results (:mod:`loadtest.report`). A target that cannot run here is recorded as
skipped with its reason, one that fails to start as failed; the others still run. Bodies are
rendered and http images fetched once before the clock starts. Every load level and repetition
sends new content, the same for every target (:func:`level_specs`), so no cache answers a level
from an earlier one (the reuse workload measures hits). Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import msgspec

from loadtest import client, cpu, metrics, rediscount, spans, workloads
from loadtest.loadgen import LoadShape, drive
from loadtest.targets import Endpoint, TargetOptions, Targets, TargetSkipped

log = logging.getLogger("loadtest")


@dataclass
class BenchConfig:
    targets: list[str]
    workload: workloads.WorkloadConfig
    shapes: list[LoadShape]
    out_dir: Path
    delivery: str = "data"
    model: str = "mmfleet-demo"
    temperature: float = 0.0
    slos: dict[str, float] = field(default_factory=dict)
    warmup: int = 2
    timeout_s: float = 120.0
    media_latency_ms: tuple[float, float] = (0.0, 0.0)
    progress: bool = True
    idle_cpu_s: float = 5.0  # idle window before the first load level: the target's idle CPU
    repeat: int = 1  # each load level this many times in a row (labels get " #k")
    # with repeat: repetition k of every target before repetition k + 1 of any, each target started
    # afresh for it, so that the machine's drift over minutes falls on every target alike
    interleave: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


def run_bench(cfg: BenchConfig, opts: TargetOptions, after=None) -> dict:
    """Runs everything; returns ``{"config", "runs": [...], "skipped": {target: reason}}``.
    ``after(endpoint) -> dict``: run against each target once our load is done, while it is
    still up (another client); its results land under ``result["after"][target]``."""
    specs = workloads.build(cfg.workload)
    levels = level_specs(cfg, specs)
    warm_specs = workloads.build(replace(cfg.workload, seed=cfg.workload.seed + 10_007,
                                         num_requests=max(1, cfg.warmup)))[:cfg.warmup]
    # the machine's load before and after: on a small shared machine other work skews every figure
    result: dict = {"config": cfg.to_dict(), "runs": [], "skipped": {}, "failed": {}, "targets": {},
                    "load_average_1m": {"start": os.getloadavg()[0]}}
    with ExitStack() as stack:
        media_base = None
        if cfg.delivery == "http":
            from loadtest.media_server import MediaServerProcess

            mean, std = cfg.media_latency_ms
            media_base = stack.enter_context(MediaServerProcess(opts.log_dir, latency_mean_ms=mean,
                                                                latency_std_ms=std)).base_url
            asyncio.run(_prefetch(media_base, [sp for level in levels for sp in level] + warm_specs))
        targets = stack.enter_context(Targets(opts))
        rounds = [range(k, k + 1) for k in range(cfg.repeat)] if cfg.interleave else [range(cfg.repeat)]
        for reps in rounds:
            for spec in cfg.targets:
                if spec in result["skipped"] or spec in result["failed"]:
                    continue
                try:
                    with targets.open(spec) as ep:
                        log.info("%s ready at %s", spec, ep.base_url)
                        result["targets"].setdefault(spec, {"base_url": ep.base_url, **ep.info})
                        result["runs"] += asyncio.run(_run_target(ep, cfg, levels, warm_specs, media_base, reps))
                        if after is not None and reps.start == 0:
                            result.setdefault("after", {})[spec] = after(ep)
                except TargetSkipped as exc:
                    log.warning("%s skipped: %s", spec, exc)
                    result["skipped"][spec] = str(exc)
                except Exception as exc:  # noqa: BLE001 - one broken target must not lose the others' figures
                    log.error("%s failed: %s", spec, exc)
                    result["failed"][spec] = f"{type(exc).__name__}: {exc}"[:2000]
    result["load_average_1m"]["end"] = os.getloadavg()[0]
    return result


async def _prefetch(media_base: str, specs: list[workloads.RequestSpec]) -> None:
    names = sorted({img.name for s in specs for img in s.images})
    async with aiohttp.ClientSession() as session:
        for name in names:
            async with session.get(f"{media_base}/img/{name}") as resp:
                resp.raise_for_status()
                await resp.read()


def level_specs(cfg: BenchConfig, first: list) -> list[list]:
    """The requests of each (load level, repetition) in run order: ``first`` for the first,
    then the workload with seed + 101·n for the n-th (new images and texts every time)."""
    n = max(1, len(cfg.shapes) * cfg.repeat)
    return [first, *(workloads.build(replace(cfg.workload, seed=cfg.workload.seed + 101 * i)) for i in range(1, n))]


async def _run_target(ep: Endpoint, cfg: BenchConfig, levels: list[list], warm_specs,
                      media_base: str | None, reps: range | None = None) -> list[dict]:
    """``levels``: the requests of each load level and repetition, in run order (a single
    list serves every level); ``reps``: the repetitions to run now (default: all)."""
    url = ep.base_url + "/v1/chat/completions"

    def body(spec: workloads.RequestSpec) -> dict:
        return workloads.render(spec, model=cfg.model, delivery=cfg.delivery, media_base=media_base,
                                temperature=cfg.temperature)

    levels = levels or [[]]
    level_bodies = [[body(s) for s in level] for level in levels]
    # no client-side connection cap: the load shape alone decides what is in flight
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for w in warm_specs:
            rec = await client.send(session, url, body(w), timeout_s=cfg.timeout_s)
            if not rec.ok:
                log.warning("%s warm-up request failed: %s %s", ep.name, rec.status, rec.error)
        fleet = ep.name.startswith("fleet:")
        idle = await cpu.idle_pct(ep.pid, cfg.idle_cpu_s, with_infra=fleet) if cfg.shapes else None
        runs = []
        for i, shape in enumerate(cfg.shapes):
            for k in (reps if reps is not None else range(cfg.repeat)):
                at = min(i * cfg.repeat + k, len(levels) - 1)
                with cpu.CpuWindow(ep.pid, with_infra=fleet) as busy:
                    run = await _run_shape(ep, cfg, session, url, levels[at], level_bodies[at], shape)
                run["cpu"] = {"idle_pct": idle, "load_pct": busy.pct if ep.pid else None,
                              "by_process_s": busy.by_role_s if ep.pid else {}, "window_s": busy.wall_s,
                              "by_thread_s": busy.by_thread_s if ep.pid else {},
                              "switches": busy.switches if ep.pid else {},
                              "counts": "target processes" + (" + broker + redis" if fleet else "")}
                run["base_label"] = shape.label
                if cfg.repeat > 1:
                    run["label"] = f"{shape.label} #{k + 1}"
                runs.append(run)
    return runs


async def _run_shape(ep: Endpoint, cfg: BenchConfig, session, url: str, specs, bodies, shape: LoadShape) -> dict:
    bar = _progress(f"{ep.name} {shape.label}", shape.max_requests, cfg.progress)

    async def send_one(i: int, t0: float) -> client.RequestRecord:
        k = i % len(specs)  # a shape asking for more requests than the workload has cycles it
        rec = await client.send(session, url, bodies[k], index=i, run_t0=t0, timeout_s=cfg.timeout_s)
        rec.n_images = len(specs[k].images)
        return rec

    async with rediscount.Census(ep.redis_url) as census:
        wall0 = time.time()
        try:
            records, timing = await drive(shape, send_one, on_done=lambda _r: bar.update(1),
                                          sessions=workloads.sessions_of(specs) if shape.kind == "sessions" else None)
        finally:
            bar.close()
        await census.read_after()  # before the spans are read from that Redis below
    records.sort(key=lambda r: r.index)
    agg = metrics.aggregate(records, timing.duration_s, cfg.slos)
    ids = [r.request_id for r in records if r.ok]
    if ep.redis_url and ep.redis_prefix:
        fetched = await spans.fetch_spans(ep.redis_url, ep.redis_prefix, ids)
    elif ep.spans_url:
        fetched = await spans.fetch_spans_http(ep.spans_url, ids)
    else:
        fetched = {"spans": {}, "reason": "no token streams to read (not a fleet target, or no --redis-url)"}
    per_request: dict[str, list[dict]] = fetched["spans"]
    breakdown = spans.aggregate_spans(fetched)
    routes, lags = await _kv_audit(ep, ids)
    return {"target": ep.name, "label": shape.label, "shape": shape.to_dict(), "started_unix_s": wall0,
            "stopped_by": timing.stopped_by, "aggregates": agg, "spans": breakdown, "kv_event_lags_ms": lags,
            "redis_commands": census.per_request(agg["ok"]),
            "records": [{**r.to_dict(), "spans": per_request.get(r.request_id or ""),
                         **({"route": routes[r.request_id]} if r.request_id in routes else {})} for r in records]}


async def _kv_audit(ep: Endpoint, ids: list[str]) -> tuple[dict, list[float]]:
    """A fleet's routing notes per request and its KV-event lags (``shared.kv.audit``)."""
    if not (ep.redis_url and ep.redis_prefix):
        return {}, []
    from shared.kv import audit

    try:
        notes = await audit.read_notes(ep.redis_url, ep.redis_prefix, ids)
        return ({rid: msgspec.to_builtins(n) for rid, n in notes.items()},
                await audit.read_lags(ep.redis_url, ep.redis_prefix))
    except Exception as exc:  # noqa: BLE001 - the run's own figures still count
        log.warning("%s: routing notes unreadable: %r", ep.name, exc)
        return {}, []


class _Bar:
    """A minimal stderr progress line, for when tqdm is unavailable or output is not a tty."""

    def __init__(self, desc: str, total: int) -> None:
        self.desc, self.total, self.n = desc, total, 0

    def update(self, k: int) -> None:
        self.n += k
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(desc: str, total: int, enabled: bool):
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Bar(desc, total)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="req", leave=True, dynamic_ncols=True,
                mininterval=0.5)


class _Silent:
    def update(self, _k: int) -> None:
        pass

    def close(self) -> None:
        pass
