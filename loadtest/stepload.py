"""Step load, autoscaled vs fixed: ``python -m loadtest step`` (part of ``make bench``).

The same open-loop load (idle, a burst at ``burst_rate`` requests/s, idle) against two fleets of
one mode (default ``e-pd``) on a broker and Redis the harness starts: ``autoscaled`` (``mmfleet
up --autoscale``, 1..``max_workers`` workers per stage group) and ``fixed`` (``max_workers`` per
group all along). Per fleet: TTFT p50/p99 over the run and over the burst against the SLO, failed
requests, and worker-seconds (worker processes sampled every 0.5 s from /proc): what autoscaling
saves. The plot shows worker count and each request's TTFT over time. One 224x224 image, 32
tokens, temperature 0. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from loadtest import metrics, procs
from loadtest.client import send
from loadtest.targets import _stop_supervisor, _wait_file
from loadtest.workloads import WorkloadConfig, build, render


@dataclass(frozen=True)
class StepConfig:
    idle_s: float = 15.0
    burst_s: float = 30.0
    tail_s: float = 45.0
    idle_rate: float = 0.25  # requests/s while "idle": TTFT is measured before and after the burst too
    burst_rate: float = 3.0
    max_workers: int = 2
    mode: str = "e-pd"  # two stage groups: a fixed fleet at 2 per group starts on 2 shared cores
    ttft_slo_ms: float = 2000.0
    scale_down_after_s: float = 10.0

    def arrivals(self) -> list[float]:
        """Send times (s after the start), evenly spaced within each phase."""
        out, t = [], 0.0
        for length, rate in ((self.idle_s, self.idle_rate), (self.burst_s, self.burst_rate),
                             (self.tail_s, self.idle_rate)):
            n = int(length * rate)
            out += [t + i / rate for i in range(n)]
            t += length
        return out


async def _load(base: str, bodies: list[dict], arrivals: list[float], timeout_s: float) -> list[dict]:
    url = base + "/v1/chat/completions"
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        async def one(i: int, at: float):
            await asyncio.sleep(max(at - (time.perf_counter() - t0), 0))
            return await send(session, url, bodies[i % len(bodies)], index=i, run_t0=t0, timeout_s=timeout_s)

        recs = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return [r.to_dict() | {"text": ""} for r in recs]


def run_fleet(label: str, up_args: list[str], env: dict[str, str], cfg: StepConfig, bodies: list[dict],
              infra: tuple[str, str], log_dir: Path, ready_timeout_s: float) -> dict:
    """One fleet under the step load: its records, worker-count samples and summary."""
    port = procs.free_port()
    bootstrap, redis_url = infra
    env = {**env, "KAFKA_BOOTSTRAP": bootstrap, "REDIS_URL": redis_url, "MMFLEET_GATEWAY_PORT": str(port),
           "MMFLEET_REDIS_PREFIX": f"step-{label}-{uuid.uuid4().hex[:6]}"}
    fleet_logs = log_dir / label
    fleet_logs.mkdir(parents=True, exist_ok=True)
    ready = fleet_logs / "ready"
    proc = procs.spawn([sys.executable, "-m", "services.cli", "up", "--mode", cfg.mode, "--log-dir", str(fleet_logs),
                        "--ready-file", str(ready), *up_args], log_path=fleet_logs / "supervisor.log", env=env,
                       cwd=procs.REPO)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        _wait_file(ready, proc, ready_timeout_s, fleet_logs / "supervisor.log")
        t0 = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter() - t0, procs.worker_count(proc.pid)))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            records = asyncio.run(_load(f"http://127.0.0.1:{port}", bodies, cfg.arrivals(), timeout_s=120))
        finally:
            stop.set()
            sampler.join()
    finally:
        _stop_supervisor(proc)
    return {"label": label, "records": records, "workers": samples, **summarize(records, samples, cfg)}


def summarize(records: list[dict], samples: list[tuple[float, int]], cfg: StepConfig) -> dict:
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    burst = [r for r in ok if cfg.idle_s <= r["start_s"] < cfg.idle_s + cfg.burst_s]

    def pct(rs, p):
        xs = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        return round(metrics.percentile(xs, p), 1) if xs else None

    worker_s = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(samples, samples[1:], strict=False))
    return {"requests": len(records), "failed": len(records) - len(ok),
            "ttft_p50_ms": pct(ok, 50), "ttft_p99_ms": pct(ok, 99),
            "burst_ttft_p50_ms": pct(burst, 50), "burst_ttft_p99_ms": pct(burst, 99),
            "worker_seconds": round(worker_s, 1), "peak_workers": max((n for _, n in samples), default=0),
            "run_s": round(samples[-1][0], 1) if samples else 0.0}


def run_step(out: Path, model_dir: Path, cfg: StepConfig, *, ready_timeout_s: float = 300) -> dict:
    import os

    specs = build(WorkloadConfig(kind="image", num_requests=32, resolutions=((224, 224),), max_tokens=(32, 32)))
    bodies = [render(s, model="mmfleet-demo") for s in specs]
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "MMFLEET_MODEL_PATH": str(model_dir), "MMFLEET_AUTOSCALE_TTFT_SLO_MS": str(int(cfg.ttft_slo_ms))}
    n = cfg.max_workers
    fleets = {
        "autoscaled": (["--autoscale"], {"MMFLEET_AUTOSCALE_MIN_WORKERS": "1", "MMFLEET_AUTOSCALE_MAX_WORKERS": str(n),
                                         "MMFLEET_AUTOSCALE_SCALE_DOWN_AFTER_S": str(cfg.scale_down_after_s)}),
        "fixed": ([], {"MMFLEET_STAGE_REPLICAS": f"media-fetch={n},encode={n},prefill={n},decode={n}"}),  # per group
    }
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # the machine's other load skews every figure on 2 shared cores: recorded around each fleet
    result = {"config": asdict(cfg), "fleets": {}, "load_average_1m": {}}
    with procs.broker(logs) as bootstrap, procs.redis_server(logs) as redis_url:
        for label, (args, env) in fleets.items():
            before = os.getloadavg()[0]
            result["fleets"][label] = run_fleet(label, args, {**base_env, **env}, cfg, bodies,
                                                (bootstrap, redis_url), logs, ready_timeout_s)
            result["load_average_1m"][label] = [before, os.getloadavg()[0]]
    return result


def write(result: dict, out: Path, *, plots: bool = True) -> Path:
    (out / "step.json").write_text(json.dumps(result, indent=1))
    cfg = result["config"]
    lines = [f"# Step load ({cfg['mode']}): autoscaled vs fixed at {cfg['max_workers']} workers per stage group", "",
             f"idle {cfg['idle_s']:.0f} s at {cfg['idle_rate']} req/s → burst {cfg['burst_s']:.0f} s at "
             f"{cfg['burst_rate']} req/s → idle {cfg['tail_s']:.0f} s; TTFT SLO {cfg['ttft_slo_ms']:.0f} ms (p99)", "",
             "| fleet | requests | failed | TTFT p50 / p99 ms | burst TTFT p50 / p99 ms | p99 within SLO | "
             "worker-seconds | peak workers |", "|---|---|---|---|---|---|---|---|"]
    for label, f in result["fleets"].items():
        within = "yes" if f["ttft_p99_ms"] is not None and f["ttft_p99_ms"] <= cfg["ttft_slo_ms"] else "no"
        lines.append(f"| {label} | {f['requests']} | {f['failed']} | {f['ttft_p50_ms']} / {f['ttft_p99_ms']} | "
                     f"{f['burst_ttft_p50_ms']} / {f['burst_ttft_p99_ms']} | {within} | {f['worker_seconds']} | "
                     f"{f['peak_workers']} |")
    loads = result.get("load_average_1m") or {}
    if loads:
        lines += ["", "Load average (1 min) before / after each fleet's run (other work on the machine skews "
                      "every figure): " + "; ".join(f"{k} {a:.1f} / {b:.1f}" for k, (a, b) in loads.items())]
    if plots:
        lines += ["", f"Plot: {plot(result, out)}"]
    path = out / "step.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(result: dict, out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install -e '.[bench]')"
    cfg = result["config"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for label, f in result["fleets"].items():
        top.step([t for t, _ in f["workers"]], [n for _, n in f["workers"]], where="post", label=label)
        ok = [r for r in f["records"] if r["ttft_ms"] is not None]
        bottom.scatter([r["start_s"] for r in ok], [r["ttft_ms"] for r in ok], s=8, label=label)
    for ax in (top, bottom):
        ax.axvspan(cfg["idle_s"], cfg["idle_s"] + cfg["burst_s"], color="grey", alpha=0.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    bottom.axhline(cfg["ttft_slo_ms"], color="red", linestyle="--", linewidth=1)
    top.set(ylabel="worker processes", title="step load: idle → burst (shaded) → idle")
    bottom.set(ylabel="TTFT ms (request sent at x)", xlabel="s since the load started", yscale="log")
    fig.tight_layout()
    fig.savefig(out / "step.png", dpi=110)
    plt.close(fig)
    return "`step.png`"
