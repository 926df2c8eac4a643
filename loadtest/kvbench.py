"""KV-aware routing vs round-robin: ``python -m loadtest kv`` (part of ``make bench``).

Multi-turn workloads (``LONG``, then ``SHORT``; turn-major, so a session's turns go in order)
against two ``fleet:e-p-d`` fleets with ``prefill_replicas`` prefill workers, routing ``kv`` and
``round_robin``, per engine in ``engines`` (rows ``<engine>/<policy>`` when several). Per policy,
over follow-up turns: request and token hit rates, TTFT p50 / p99, why follow-ups missed
(``shared.kv.audit``) and the KV events' lag into the routing table. Goals: hit rate >= 90 %;
follow-up TTFT p50 >= 2x better than round-robin, p99 no worse; ``repeats`` runs the first
workload again, the policies alternating, goals on the medians. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest import metrics
from loadtest.bench import BenchConfig, run_bench
from loadtest.loadgen import LoadShape
from loadtest.targets import TargetOptions
from loadtest.workloads import WorkloadConfig, build

POLICIES = ("kv", "round_robin")
ENGINES = ("transformers", "vllm")
CAUSES = ("hit", "cold", "load", "evicted", "moved", "unrouted")  # as shared.kv.audit


@dataclass(frozen=True)
class Sessions:
    """One multi-turn workload of the suite."""
    name: str
    turns: int
    window: int  # images kept in the conversation
    text_words: int  # per user turn


# long: ~2k-token conversations by the last turn, every image kept (a dropped image would change
# the prefix and no router could hit); prefill is most of TTFT there. short: for contrast (prefill
# a small share of TTFT, so routing buys little).
LONG = Sessions("long", turns=5, window=5, text_words=250)
SHORT = Sessions("short", turns=4, window=4, text_words=48)


def kv_workload(sessions: int, turns: int, window: int, text_words: int, seed: int = 0) -> WorkloadConfig:
    return WorkloadConfig(kind="multiturn", num_requests=sessions * turns, seed=seed, max_tokens=(16, 16),
                          text_words=(text_words, text_words), images=(1, 1), resolutions=((224, 224),),
                          turns=turns, window=window)


def run_kv(out: Path, opts: TargetOptions, *, sessions: int, concurrency: int, replicas: int,
           workloads: tuple[Sessions, ...] = (LONG, SHORT), progress: bool = True,
           engines: tuple[str, ...] = ("transformers",), repeats: int = 1) -> dict:
    """Every workload on every engine with both policies; goals are judged on the first
    workload (the long one by default), run ``repeats`` times with the policies' order
    alternating (medians of the runs, the spread shown); the others run once, for contrast."""
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise ValueError(f"engines {unknown or '(none)'}: choose from {', '.join(ENGINES)}")
    result: dict = {"config": {"workloads": {}, "concurrency": concurrency, "prefill_replicas": replicas,
                               "engines": list(engines), "repeats": repeats}, "policies": {}, "runs": [],
                    "goals": []}
    for k, sess in enumerate(workloads):
        workload = kv_workload(sessions, sess.turns, sess.window, sess.text_words)
        result["config"]["workloads"][sess.name] = workload.to_dict()
        for engine in engines:
            prefix = "/".join(([sess.name] if len(workloads) > 1 else []) + ([engine] if len(engines) > 1 else []))
            n = repeats if k == 0 else 1
            runs = [_run_policies(result, out, opts, workload, concurrency, replicas, engine, prefix, progress,
                                  POLICIES if r % 2 == 0 else POLICIES[::-1], f" #{r + 1}" if n > 1 else "")
                    for r in range(n)]
            if k == 0:
                result["goals"] += [{**g, "goal": f"{prefix}: {g['goal']}" if prefix else g["goal"]}
                                    for g in goals(runs)]
    return result


def _run_policies(result: dict, out: Path, opts: TargetOptions, workload: WorkloadConfig, concurrency: int,
                  replicas: int, engine: str, prefix: str, progress: bool,
                  order: tuple[str, ...] = POLICIES, tag: str = "") -> dict:
    """Both policies in ``order``, one fleet each; rows named ``<prefix>/<policy><tag>``."""
    specs = build(workload)
    shape = LoadShape("concurrency", concurrency, len(specs), duration_s=600, grace_s=60)
    named = (lambda p: f"{prefix}/{p}{tag}") if prefix else (lambda p: p + tag)
    per_policy: dict = {}
    for policy in order:
        env = {**opts.extra_env, "MMFLEET_STAGE_REPLICAS": f"prefill={replicas}",
               "MMFLEET_ROUTING_POLICY": policy, "MMFLEET_TOPIC_PARTITIONS": str(max(4, 2 * replicas)),
               "MMFLEET_ENGINE": engine}
        cfg = BenchConfig(targets=["fleet:e-p-d"], workload=workload, shapes=[shape], out_dir=out, warmup=0,
                          progress=progress)
        res = run_bench(cfg, replace(opts, extra_env=env))
        for run in res["runs"]:
            run["target"] = f"fleet:e-p-d[{named(policy)}]"
            result["runs"].append(run)
            per_policy[policy] = summarize(run["records"], specs, run.get("kv_event_lags_ms"))
            result["policies"][named(policy)] = per_policy[policy]
        if res["failed"]:
            result.setdefault("failed", {}).update({f"{k}[{named(policy)}]": v for k, v in res["failed"].items()})
    return per_policy


def summarize(records: list[dict], specs, lags_ms: list[float] | None = None) -> dict:
    """Hit rates, TTFT and miss causes of one run, follow-up turns apart (see the module contract)."""
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    later = [r for r in ok if specs[r["index"] % len(specs)].turn]
    prompt = sum(r["prompt_tokens"] or 0 for r in later)
    routes = [r.get("route") or {} for r in later]
    return {
        "causes_followups": dict(Counter(rt.get("cause", "unrouted") for rt in routes)),
        "kv_event_lag_ms": {**metrics.summarize(lags_ms or []), **({"max": max(lags_ms)} if lags_ms else {})},
        "requests": len(records), "ok": len(ok), "followups": len(later),
        "request_hit_rate": sum(1 for r in later if r["cached_tokens"] > 0) / len(later) if later else None,
        "token_hit_rate": sum(r["cached_tokens"] for r in later) / prompt if prompt else None,
        "ttft_ms_followups": metrics.summarize([r["ttft_ms"] for r in later if r["ttft_ms"] is not None]),
        "ttft_ms_all": metrics.summarize([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]),
        "prefill_share_followups": prefill_share(later),
    }


def prefill_share(records: list[dict]) -> float | None:
    """Median over requests of the prefill stage's compute (its span less transfers) / TTFT."""
    shares = []
    for r in records:
        pre = [s for s in r.get("spans") or [] if s.get("stage") == "prefill"]
        if pre and r.get("ttft_ms"):
            shares.append(sum(s["total_ms"] - s.get("transfer_ms", 0.0) for s in pre) / r["ttft_ms"])
    return statistics.median(shares) if shares else None


def goals(runs: "dict | list[dict]") -> list[dict]:
    """The goals over one run's per-policy summaries, or over repeated runs' (each judged on the
    median of the runs' values; the spread is shown)."""
    runs = [runs] if isinstance(runs, dict) else runs
    pairs = [(p.get("kv"), p.get("round_robin")) for p in runs]
    rows = []
    hits = [(kv["request_hit_rate"], rr["request_hit_rate"] if rr else None) for kv, rr in pairs
            if kv and kv["request_hit_rate"] is not None]
    if hits:
        kv_hit = _spread([h for h, _ in hits], "{:.0%}")
        rr_hits = [h for _, h in hits if h is not None]
        rows.append({"goal": "kv: follow-up hit rate >= 90 %", "measured": kv_hit[0] + (
            f" (round-robin {_spread(rr_hits, '{:.0%}')[0]})" if rr_hits else ""), "met": kv_hit[1] >= 0.9})
    for q, goal, target in (("p50", "follow-up TTFT p50 >= 2x better than round-robin", 2.0),
                            ("p99", "follow-up TTFT p99 no worse than round-robin", 1.0)):
        both = [(rr["ttft_ms_followups"][q], kv["ttft_ms_followups"][q]) for kv, rr in pairs
                if kv and rr and kv["ttft_ms_followups"].get(q) and rr["ttft_ms_followups"].get(q)]
        if not both:
            continue
        ratio = _spread([a / b for a, b in both], "{:.2f}x")
        ms = (f"{both[0][0]:.1f} / {both[0][1]:.1f} ms = " if len(both) == 1 else
              f"round-robin / kv over {len(both)} alternated runs: ")
        rows.append({"goal": goal, "measured": ms + ratio[0], "met": ratio[1] >= target})
    return rows


def _spread(values: list[float], fmt: str) -> tuple[str, float]:
    """("median [min–max]", or the value when all are one; the median)."""
    med = statistics.median(values)
    text = fmt.format(med)
    if min(values) != max(values):
        text += f" [{fmt.format(min(values))}–{fmt.format(max(values))}]"
    return text, med


def write(result: dict, out: Path, plots: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_routing.json").write_text(json.dumps(result, indent=1, default=str))
    lines = ["# KV-aware routing vs round-robin", "",
             f"workload: {json.dumps(result['config'])}", "",
             "| policy | ok/requests | follow-up hit rate | token hit rate | TTFT p50 / p99 follow-ups (ms) "
             "| TTFT p50 / p99 all (ms) | prefill share of follow-up TTFT |", "|---|---|---|---|---|---|---|"]
    for name, s in result["policies"].items():
        f, a = s["ttft_ms_followups"], s["ttft_ms_all"]
        lines.append(f"| {name} | {s['ok']}/{s['requests']} | {_pct(s['request_hit_rate'])} | "
                     f"{_pct(s['token_hit_rate'])} | {_ms(f, 'p50')} / {_ms(f, 'p99')} | "
                     f"{_ms(a, 'p50')} / {_ms(a, 'p99')} | {_pct(s.get('prefill_share_followups'))} |")
    lines += ["", ("Follow-up turns by what their prefix reuse met (`shared.kv.audit`): hit / cold (no worker "
                   "listed a block) / load (another held more) / evicted (listed, gone by prefill) / moved "
                   "(rebalanced) / unrouted; KV-event lag = produce to routing-table update."), "",
              "| policy | " + " | ".join(CAUSES) + " | event lag p50 / p99 / max (ms) |",
              "|---|" + "---|" * (len(CAUSES) + 1)]
    for name, s in result["policies"].items():
        c, lag = s.get("causes_followups", {}), s.get("kv_event_lag_ms", {})
        lines.append(f"| {name} | " + " | ".join(str(c.get(k, 0)) for k in CAUSES) +
                     f" | {_ms(lag, 'p50')} / {_ms(lag, 'p99')} / {_ms(lag, 'max')} |")
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['measured']} | {'met' if g['met'] else '**not met**'} |" for g in result["goals"]]
    for name, why in result.get("failed", {}).items():
        lines.append(f"\n{name} failed: {why[:300]}")
    if plots:
        lines += ["", _plot(result, out)]
    path = out / "kv_summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def _ms(s: dict, k: str) -> str:
    return "–" if not s.get(k) else f"{s[k]:.1f}"


def _plot(result: dict, out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no plot: matplotlib is not installed; pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in result["runs"]:
        ttfts = sorted(r["ttft_ms"] for r in run["records"] if r["ttft_ms"] is not None)
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run["target"])
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("multi-turn sessions: KV-aware vs round-robin")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kv_ttft_cdf.png", dpi=100)
    plt.close(fig)
    return "![TTFT CDF](kv_ttft_cdf.png)"
