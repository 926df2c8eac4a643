"""``python -m loadtest`` / ``mmfleet bench``: benchmark the fleet against its baselines.

Examples (each command's ``--help`` for the rest; the harness: loadtest/README.md):
  python -m loadtest suite
  python -m loadtest run --target fleet:e-p-d --target inproc --workload image --concurrency 1,4,8
  python -m loadtest run --url http://127.0.0.1:8000 --redis-url redis://127.0.0.1:6379/0 \\
      --workload random-mm --images 1-3 --rate 2,4 --duration-s 60 --slo ttft_ms=200 --slo tpot_ms=50

Docs: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from pathlib import Path

from loadtest import procs

RESULTS = procs.REPO / "loadtest" / "results"


def _pair(text: str, cast=int) -> tuple:
    """``"8"`` → (8, 8); ``"8-16"`` → (8, 16)."""
    lo, _, hi = text.partition("-")
    return cast(lo), cast(hi or lo)


def _resolutions(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        w, _, h = item.strip().lower().partition("x")
        out.append((int(w), int(h)))
    return tuple(out)


def _values(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="results directory (default loadtest/results/<timestamp>)")
    p.add_argument("--model-dir", type=Path, help="model directory (default: MMFLEET_MODEL_PATH or the demo model)")
    p.add_argument("--model", default="mmfleet-demo", help="served model name the requests ask for")
    p.add_argument("--fleet-env", action="append", default=[], metavar="MMFLEET_X=V",
                   help="setting for started fleets and inproc (repeatable)")
    p.add_argument("--vllm-python", help="interpreter with vllm for the vllm-serve target")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    p.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                   help="goodput SLO, e.g. ttft_ms=200, tpot_ms=50, e2e_ms=2000 (repeatable)")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests per target first")
    p.add_argument("--timeout-s", type=float, default=120, help="per-request timeout")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--idle-cpu-s", type=float, default=5.0,
                   help="seconds of idle before the first load level, to measure the target's idle CPU")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each load level this many times (the summary gives medians and the spread)")
    p.add_argument("--interleave", action="store_true",
                   help="with --repeat: repetition k of every target before repetition k+1 of any, each "
                        "target started afresh for it (the machine's drift falls on every target alike)")
    p.add_argument("--no-progress", action="store_true")


def _parser() -> argparse.ArgumentParser:
    from loadtest import inproc_server, media_server

    p = argparse.ArgumentParser(prog="loadtest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)

    _add_run(sub)

    _add_suites(sub)

    from loadtest import split

    split.add_arguments(sub.add_parser("split", help="encode / prefill / decode split of a Qwen2-VL, in one process"))
    from loadtest import stepcost

    stepcost.add_arguments(sub.add_parser("steps", help="a batched decode step's CPU cost by batch width"))
    from loadtest import coldcost

    coldcost.add_arguments(sub.add_parser("cold", help="a forward's CPU cost hot, after a sleep, after other work"))
    media_server.add_arguments(sub.add_parser("media-server", help="serve deterministic test images"))
    inproc_server.add_arguments(sub.add_parser("inproc", help="run the in-process OpenAI server"))
    return p


def _add_run(sub) -> None:
    """``run``: one workload under load shapes against targets."""
    from loadtest.workloads import KINDS
    from services.modes import MODES

    run = sub.add_parser("run", help="one benchmark")
    run.add_argument("--target", action="append", default=[],
                     help=f"fleet:<{'|'.join(MODES)}>, inproc, vllm-serve, url:<base> (repeatable)")
    run.add_argument("--url", help="an already running server (same as --target url:<URL>)")
    run.add_argument("--redis-url", help="Redis of the --url fleet, for the per-stage breakdown")
    run.add_argument("--redis-prefix", default="mm", help="its redis_prefix setting (default mm)")
    run.add_argument("--workload", choices=KINDS, default="image")
    run.add_argument("--num-requests", type=int, default=32, help="requests per load level")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--max-tokens", type=_pair, default=(32, 32), help="N or MIN-MAX")
    run.add_argument("--text-words", type=_pair, default=(8, 16), help="N or MIN-MAX words of prompt text")
    run.add_argument("--images", type=_pair, default=(1, 1), help="N or MIN-MAX images per request (per turn)")
    run.add_argument("--resolutions", type=_resolutions, default=((224, 224), (448, 336)), help="WxH,WxH,...")
    run.add_argument("--image-format", choices=["png", "jpg"], default="png")
    run.add_argument("--pool-size", type=int, default=8, help="reuse: images in the shared pool")
    run.add_argument("--reuse-ratio", type=float, default=0.5, help="reuse: share of image slots from the pool")
    run.add_argument("--turns", type=int, default=3, help="multiturn, sliding-window: turns per session")
    run.add_argument("--window", type=int, default=2,
                     help="multiturn: images kept in the conversation; sliding-window: images per request")
    run.add_argument("--delivery", choices=["data", "http"], default="data")
    run.add_argument("--media-latency-ms", type=lambda s: _pair(s.replace(",", "-"), float), default=(0.0, 0.0),
                     help="http delivery: injected latency MEAN[,STD] per image")
    run.add_argument("--temperature", type=float, default=0.0)
    load = run.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_values, help="N or N1,N2,... (a sweep); default 1")
    load.add_argument("--rate", type=_values, help="Poisson requests/s, R or R1,R2,... (a sweep)")
    load.add_argument("--users", type=_values,
                      help="N or N1,N2,...: users at once, each sending its session's turns in sequence")
    run.add_argument("--max-concurrency", type=int, help="rate: cap on requests in flight")
    run.add_argument("--duration-s", type=float, default=120, help="no new request after this, per load level")
    run.add_argument("--grace-s", type=float, default=60, help="then wait this long for requests in flight")
    _common(run)


def _add_suites(sub) -> None:
    """The suites: suite, engines, kv, step, reuse."""
    from services.modes import MODES

    suite = sub.add_parser("suite", help="the standard suite (a few minutes)")
    suite.add_argument("--target", action="append", default=[], help="override the suite's targets (repeatable)")
    suite.add_argument("--low-requests", type=int, default=24, help="requests at concurrency 1")
    suite.add_argument("--sat-requests", type=int, default=48, help="requests at concurrency 8")
    suite.add_argument("--duration-s", type=float, default=60)
    _common(suite)

    engines = sub.add_parser("engines", help="vLLM-engine fleets vs vllm serve, our client and vLLM's")
    engines.add_argument("--target", action="append", default=[], help="override the targets (repeatable)")
    engines.add_argument("--low-requests", type=int, default=16, help="requests at concurrency 1 (each client)")
    engines.add_argument("--sat-requests", type=int, default=32, help="requests at concurrency 8 (each client)")
    engines.add_argument("--duration-s", type=float, default=60)
    _common(engines)

    kv = sub.add_parser("kv", help="KV-aware routing vs round-robin on multi-turn sessions")
    kv.add_argument("--sessions", type=int, default=13,
                    help="sessions (not a multiple of --prefill-replicas: round-robin would pin sessions by accident)")
    kv.add_argument("--turns", type=int, default=5, help="turns per session (the long workload)")
    kv.add_argument("--window", type=int, help="images kept in the conversation (sliding window; default: all)")
    kv.add_argument("--text-words", type=int, default=250, help="words of text per user turn (the long workload)")
    kv.add_argument("--no-short", action="store_true",
                    help="skip the short workload (4 turns x 48 words) run after the long one for contrast")
    kv.add_argument("--concurrency", type=int, default=4)
    kv.add_argument("--prefill-replicas", type=int, default=3)
    kv.add_argument("--repeats", type=int, default=1,
                    help="runs of the long workload, the policies' order alternating; goals on their medians")
    kv.add_argument("--engine", action="append", choices=["transformers", "vllm"], default=[],
                    help="language-model engine of the fleets (repeatable: each runs both policies); "
                         "default transformers")
    _common(kv)
    step = sub.add_parser("step", help="step load (idle -> burst -> idle): --autoscale vs a fixed maximal fleet")
    step.add_argument("--burst-rate", type=float, default=3.0, help="requests/s during the burst")
    step.add_argument("--burst-s", type=float, default=30.0)
    step.add_argument("--max-workers", type=int, default=2,
                      help="per stage: the fixed fleet's size, the autoscaler's bound")
    step.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    step.add_argument("--mode", default="e-pd", choices=list(MODES))
    _common(step)
    reuse = sub.add_parser("reuse", help="embedding cache on vs off over image reuse ratios")
    reuse.add_argument("--target", action="append", default=[],
                       help="cache on, cache off, then optionally a baseline and a fleet compared with it "
                            "(default fleet:e-p-d, fleet:e-p-d,embedding_cache_bytes=0, vllm-serve and "
                            "fleet:e-p-d,engine=vllm)")
    reuse.add_argument("--ratios", type=_values, default=[0.0, 0.5, 0.8, 0.9], help="reuse ratios, e.g. 0,0.5,0.8,0.9")
    reuse.add_argument("--num-requests", type=int, default=24, help="requests per ratio and repeat")
    reuse.add_argument("--repeats", type=int, default=2, help="runs of every ratio on every target")
    reuse.add_argument("--concurrency", type=int, default=4)
    reuse.add_argument("--pool-size", type=int, default=4, help="images in the reused pool (each first use is a miss)")
    reuse.add_argument("--duration-s", type=float, default=120)
    _common(reuse)
    window = sub.add_parser("window", help="sliding image windows: the fleet, cache off, vLLM engine, vllm serve")
    window.add_argument("--target", action="append", default=[],
                        help="the fleet first, then the others (default fleet:e-p-d, fleet:e-p-d,engine=vllm, "
                             "fleet:e-p-d,embedding_cache_bytes=0, vllm-serve); goals: the first against vllm-serve")
    window.add_argument("--users", type=int, default=4, help="users at once, each sending its turns in sequence")
    window.add_argument("--turns", type=int, default=6)
    window.add_argument("--window", type=int, default=4, help="images in each request (one new a turn)")
    window.add_argument("--side", type=int, default=448, help="image side (px)")
    window.add_argument("--text-words", type=int, default=40)
    window.add_argument("--output-tokens", type=int, default=16)
    window.add_argument("--repeats", type=int, default=3, help="rounds over every target, the order rotating")
    window.add_argument("--duration-s", type=float, default=300)
    window.add_argument("--vllm-client", action="store_true",
                        help="then replay the same kind of requests with vLLM's own client on every target")
    _common(window)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "media-server":
        from loadtest.media_server import serve_main

        return serve_main(args)
    if args.command == "inproc":
        from loadtest.inproc_server import serve_main

        return serve_main(args)
    if args.command == "split":
        from loadtest.split import run

        return run(args)
    if args.command == "steps":
        from loadtest.stepcost import run

        return run(args)
    if args.command == "cold":
        from loadtest.coldcost import run

        return run(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from loadtest import metrics, report, suite, vllmclient
    from loadtest.bench import BenchConfig, run_bench
    from loadtest.loadgen import LoadShape
    from loadtest.targets import TargetOptions, parse_spec
    from loadtest.workloads import WorkloadConfig

    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    try:
        slos = dict(metrics.parse_slo(s) for s in args.slo)
        extra_env = dict(kv.split("=", 1) for kv in args.fleet_env)
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    if args.command == "kv":
        return _kv(args, out, logs, extra_env)
    if args.command == "reuse":
        return _reuse(args, out, logs, slos, extra_env)
    if args.command == "step":
        return _step(args, out)
    if args.command == "window":
        return _window(args, out, logs, slos, extra_env)
    if args.command in ("suite", "engines"):
        targets = args.target or (suite.TARGETS if args.command == "suite" else vllmclient.TARGETS)
        workload = suite.suite_workload(max(args.low_requests, args.sat_requests))
        shapes = suite.suite_shapes(args.low_requests, args.sat_requests, args.duration_s)
        delivery, media_latency, temperature = "http", (0.0, 0.0), 0.0
        redis_url, redis_prefix = None, "mm"
    else:
        targets = args.target + ([f"url:{args.url}"] if args.url else [])
        if not targets:
            print("loadtest run: give at least one --target or --url", file=sys.stderr)
            return 2
        workload = WorkloadConfig(kind=args.workload, num_requests=args.num_requests, seed=args.seed,
                                  max_tokens=args.max_tokens, text_words=args.text_words, images=args.images,
                                  resolutions=args.resolutions, image_format=args.image_format,
                                  pool_size=args.pool_size, reuse_ratio=args.reuse_ratio, turns=args.turns,
                                  window=args.window)
        kind, values = (("rate", args.rate) if args.rate else ("sessions", args.users) if args.users
                        else ("concurrency", args.concurrency or [1]))
        shapes = [LoadShape(kind, v, args.num_requests, duration_s=args.duration_s, grace_s=args.grace_s,
                            max_concurrency=args.max_concurrency if kind == "rate" else None, seed=args.seed)
                  for v in values]
        delivery, media_latency, temperature = args.delivery, args.media_latency_ms, args.temperature
        redis_url, redis_prefix = args.redis_url, args.redis_prefix
    try:
        for t in targets:
            parse_spec(t)
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    cfg = BenchConfig(targets=targets, workload=workload, shapes=shapes, out_dir=out, delivery=delivery,
                      model=args.model, temperature=temperature, slos=slos, warmup=args.warmup,
                      timeout_s=args.timeout_s, media_latency_ms=media_latency, progress=not args.no_progress,
                      idle_cpu_s=args.idle_cpu_s, repeat=args.repeat, interleave=args.interleave)
    opts = TargetOptions(model_dir=procs.model_dir(args.model_dir), log_dir=logs, served_model_name=args.model,
                         extra_env=extra_env, vllm_python=args.vllm_python, ready_timeout_s=args.ready_timeout_s,
                         redis_url=redis_url, redis_prefix=redis_prefix)
    after = None
    if args.command == "engines":  # vLLM's own client against each target, after ours
        after = functools.partial(vllmclient.run_client, model=args.model, tokenizer=opts.model_dir, out_dir=out,
                                  num_prompts={1: args.low_requests, 8: args.sat_requests})
    result = run_bench(cfg, opts, after=after)
    goals = suite.evaluate_goals(result) if args.command in ("suite", "engines") else None
    summary = report.write_all(result, out, goals=goals, plots=not args.no_plots)
    if args.command == "engines":
        theirs = result.get("after", {})
        png = None if args.no_plots else vllmclient.plot(theirs, out)
        with open(summary, "a") as f:
            f.write("\n" + "\n".join(vllmclient.table_md(theirs) + vllmclient.goals_md(theirs))
                    + (f"\n![vLLM's client]({png})\n" if png else ""))
    print(summary.read_text())
    print(f"results in {out}", file=sys.stderr)
    return 1 if result["failed"] or not result["runs"] else 0


def _kv(args: argparse.Namespace, out: Path, logs: Path, extra_env: dict) -> int:
    from loadtest import kvbench
    from loadtest.targets import TargetOptions

    opts = TargetOptions(model_dir=procs.model_dir(args.model_dir), log_dir=logs, served_model_name=args.model,
                         extra_env=extra_env, ready_timeout_s=args.ready_timeout_s)
    long = kvbench.Sessions("long", args.turns, args.window or args.turns, args.text_words)
    result = kvbench.run_kv(out, opts, sessions=args.sessions, concurrency=args.concurrency,
                            workloads=(long,) if args.no_short else (long, kvbench.SHORT),
                            replicas=args.prefill_replicas, progress=not args.no_progress,
                            engines=tuple(dict.fromkeys(args.engine)) or ("transformers",),
                            repeats=max(1, args.repeats))
    print(kvbench.write(result, out, plots=not args.no_plots).read_text())
    print(f"results in {out}", file=sys.stderr)
    return 1 if result.get("failed") or not result["runs"] else 0


def _step(args: argparse.Namespace, out: Path) -> int:
    from loadtest import stepload

    cfg = stepload.StepConfig(burst_rate=args.burst_rate, burst_s=args.burst_s, max_workers=args.max_workers,
                              ttft_slo_ms=args.ttft_slo_ms, mode=args.mode)
    result = stepload.run_step(out, procs.model_dir(args.model_dir), cfg, ready_timeout_s=args.ready_timeout_s)
    print(stepload.write(result, out, plots=not args.no_plots).read_text())
    print(f"results in {out}", file=sys.stderr)
    return 1 if any(f["failed"] for f in result["fleets"].values()) else 0


def _reuse(args: argparse.Namespace, out: Path, logs: Path, slos: dict, extra_env: dict) -> int:
    from loadtest import report, reuse
    from loadtest.bench import BenchConfig
    from loadtest.targets import TargetOptions, parse_spec

    targets = args.target or [reuse.ON, reuse.OFF, reuse.VLLM, reuse.VLLM_FLEET]
    if len(targets) not in (2, 3, 4):
        print("loadtest reuse: give two to four --target (cache on, off, then a baseline, then a second fleet "
              "compared with it) or none", file=sys.stderr)
        return 2
    for t in targets:
        parse_spec(t)
    cfg = BenchConfig(targets=targets, workload=reuse.default_workload(args.num_requests, args.pool_size),
                      shapes=[reuse.default_shape(args.concurrency, args.num_requests, args.duration_s)],
                      out_dir=out, model=args.model, slos=slos, warmup=args.warmup, timeout_s=args.timeout_s,
                      progress=not args.no_progress)
    opts = TargetOptions(model_dir=procs.model_dir(args.model_dir), log_dir=logs, served_model_name=args.model,
                         extra_env=extra_env, vllm_python=args.vllm_python, ready_timeout_s=args.ready_timeout_s)
    result = reuse.run_reuse(cfg, opts, ratios=args.ratios, repeats=args.repeats)
    goals, lines = reuse.table(result, *targets)  # on, off[, baseline[, second fleet]]
    summary = report.write_all(result, out, goals=goals, plots=not args.no_plots)
    extra = reuse.plot(result, out, *targets[:3]) if not args.no_plots else None
    text = summary.read_text() + "\n" + "\n".join(lines) + "\n" + (f"\nPlot: `{extra}`\n" if extra else "")
    summary.write_text(text)
    print(text)
    print(f"results in {out}", file=sys.stderr)
    return 1 if result["failed"] or not result["runs"] else 0




def _window(args: argparse.Namespace, out: Path, logs: Path, slos: dict, extra_env: dict) -> int:
    from loadtest import report, window
    from loadtest.bench import BenchConfig
    from loadtest.targets import TargetOptions, parse_spec

    targets = args.target or window.TARGETS
    for t in targets:
        parse_spec(t)
    wl = window.default_workload(args.users, args.turns, args.window, args.side, args.text_words, args.output_tokens)
    cfg = BenchConfig(targets=targets, workload=wl, shapes=[window.shape(args.users, wl.num_requests, args.duration_s)],
                      out_dir=out, model=args.model, slos=slos, warmup=args.warmup, timeout_s=args.timeout_s,
                      progress=not args.no_progress)
    opts = TargetOptions(model_dir=procs.model_dir(args.model_dir), log_dir=logs, served_model_name=args.model,
                         extra_env=extra_env, vllm_python=args.vllm_python, ready_timeout_s=args.ready_timeout_s)
    result = window.run_window(cfg, opts, repeats=max(1, args.repeats), vllm_client=args.vllm_client)
    summary = report.write_all(result, out, plots=not args.no_plots)  # the goals: in window.summary_md
    png = None if args.no_plots else window.plot(result, out)
    if result["runs"]:
        model = os.environ.get("MMFLEET_DEMO_MODEL")
        command = ((f"MMFLEET_DEMO_MODEL={model} " if model else "")
                   + f"mmfleet bench window --users {args.users} --turns {args.turns} --window {args.window} "
                   f"--side {args.side} --text-words {args.text_words} --output-tokens {args.output_tokens} "
                   f"--repeats {args.repeats}" + (" --vllm-client" if args.vllm_client else "")
                   + "".join(f" --target {t}" for t in args.target))
        window.write_records(result, out, command)
    text = summary.read_text() + "\n" + "\n".join(window.summary_md(result)) + (f"\nPlot: `{png}`\n" if png else "")
    summary.write_text(text)
    print(text)
    print(f"results in {out}", file=sys.stderr)
    return 1 if result["failed"] or not result["runs"] else 0
