"""Writing a benchmark's results to ``out_dir``: ``runs/<target>__<load>.json`` (config, the
target's facts, per-request records, aggregates, per-stage breakdown), ``index.json`` (all but
the records, plus skipped / failed targets and goals), ``cdf_<load>.png`` (TTFT and e2e CDFs per
target), ``throughput_vs_load.png`` (for a target run at two or more loads of one kind) and
``summary.md`` (targets side by side per load, the per-stage breakdown, goals). Plots need
matplotlib (the ``bench`` extra); without it they are skipped and the summary says so.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path

from loadtest import cpu, procs, rediscount, repeats, ttft_split


def write_all(result: dict, out_dir: Path, *, goals: list[dict] | None = None, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(exist_ok=True)
    result = {**result, "environment": environment(), "goals": goals or []}
    for run in result["runs"]:
        doc = {"config": result["config"], "target_info": result["targets"].get(run["target"], {}), **run}
        (runs_dir / f"{_slug(run['target'])}__{_slug(run['label'])}.json").write_text(json.dumps(doc, indent=1))
    index = {**result, "runs": [{k: v for k, v in r.items() if k != "records"} for r in result["runs"]]}
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    plot_note = write_plots(result["runs"], out_dir) if plots else "plots disabled (--no-plots)"
    (out_dir / "summary.md").write_text(summary_md(result, plot_note))
    return out_dir / "summary.md"


def environment() -> dict:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=procs.REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=procs.REPO,
                           capture_output=True, text=True)
    import os

    return {"git": (rev.stdout.strip() or "?") + ("+dirty" if dirty.stdout.strip() else ""),
            "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text)


def _fmt(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _stat(agg: dict, metric: str, stat: str):
    return agg.get(metric, {}).get(stat)


ROWS = [("TTFT p50 (ms)", lambda a: _stat(a, "ttft_ms", "p50")),
        ("TTFT p99 (ms)", lambda a: _stat(a, "ttft_ms", "p99")),
        ("ITL p50 (ms)", lambda a: _stat(a, "itl_ms", "p50")),
        ("TPOT p50 (ms)", lambda a: _stat(a, "tpot_ms", "p50")),
        ("e2e p50 (ms)", lambda a: _stat(a, "e2e_ms", "p50")),
        ("e2e p99 (ms)", lambda a: _stat(a, "e2e_ms", "p99")),
        ("requests/s", lambda a: a["request_throughput"]),
        ("output tokens/s", lambda a: a["output_throughput"]),
        ("goodput (req/s)", lambda a: a["goodput"]["per_s"])]


def summary_md(result: dict, plot_note: str = "") -> str:
    cfg, env = result["config"], result.get("environment", {})
    wl = cfg["workload"]
    lines = [f"# mmfleet bench — {Path(cfg['out_dir']).name}", "",
             f"- machine: {env.get('cpus')} CPUs, {env.get('machine')}, Python {env.get('python')}, "
             f"git {env.get('git')}",
             f"- workload: `{wl['kind']}`, {wl['num_requests']} requests, seed {wl['seed']}, "
             f"max_tokens {_range(wl['max_tokens'])}, text {_range(wl['text_words'])} words, "
             f"images {_images_desc(wl)}, delivery `{cfg['delivery']}`"
             + (f" (media latency {cfg['media_latency_ms'][0]}±{cfg['media_latency_ms'][1]} ms)"
                if cfg["delivery"] == "http" and any(cfg["media_latency_ms"]) else "")
             + f", temperature {cfg['temperature']}, {cfg['warmup']} warm-up requests per target",
             *([f"- load average (1 min) at start / end: {la['start']:.2f} / {la['end']:.2f} "
                f"(at start nothing of the benchmark runs yet: above ~0.5 there means other work shares the CPUs)"]
               if (la := result.get("load_average_1m", {})).get("end") is not None else []),
             f"- SLOs for goodput: {', '.join(f'{k} ≤ {v:g}' for k, v in cfg['slos'].items()) or 'none'}", ""]
    labels = list(dict.fromkeys(r["label"] for r in result["runs"]))
    for label in labels:
        runs = [r for r in result["runs"] if r["label"] == label]
        lines += [f"## Load {label}", "", "| metric | " + " | ".join(f"`{r['target']}`" for r in runs) + " |",
                  "|---|" + "---:|" * len(runs)]
        for name, get in ROWS:
            lines.append(f"| {name} | " + " | ".join(_fmt(get(r["aggregates"]), 2 if "/s" in name else 1)
                                                   for r in runs) + " |")
        lines.append("| ok / sent | " + " | ".join(f"{r['aggregates']['ok']}/{r['aggregates']['requests']}"
                                                   for r in runs) + " |")
        if len(runs) > 1 and cfg["temperature"] == 0:
            ref = {x["index"]: x["text"] for x in runs[0]["records"] if x["error"] is None}
            lines.append(f"| same text as `{runs[0]['target']}` | " + " | ".join(
                f"{sum(1 for x in r['records'] if x['index'] in ref and x['text'] == ref[x['index']])}/{len(ref)}"
                for r in runs) + " |")
        lines.append("| errors by status | " + " | ".join(
            ", ".join(f"{k}: {v}" for k, v in r["aggregates"]["errors"].items()) or "none" for r in runs) + " |")
        lines.append("")
    if result.get("skipped") or result.get("failed"):
        lines += ["## Targets not measured", ""]
        lines += [f"- `{t}` skipped: {why}" for t, why in result.get("skipped", {}).items()]
        lines += [f"- `{t}` FAILED: {why.splitlines()[0] if why else ''}"
                  for t, why in result.get("failed", {}).items()]
        lines.append("")
    lines += _breakdown_md(result["runs"])
    lines += repeats.repeats_md(result["runs"])
    lines += ttft_split.split_md(result["runs"])
    lines += cpu.by_process_md(result["runs"])
    lines += cpu.by_thread_md(result["runs"])
    lines += cpu.switches_md(result["runs"])
    lines += rediscount.commands_md(result["runs"])
    if result.get("goals"):
        lines += ["## Goals", "", "| goal | measured | verdict |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['measured']} | {g['verdict']} |" for g in result["goals"]]
        lines.append("")
    if result.get("targets"):
        lines += ["## Targets", ""]
        for t, info in result["targets"].items():
            extra = f", vllm {info['vllm']}" if "vllm" in info else ""
            lines.append(f"- `{t}`: {info.get('base_url')}, ready in {_fmt(info.get('startup_s'))} s{extra}")
        lines.append("")
    if plot_note:
        lines += [f"Plots: {plot_note}", ""]
    return "\n".join(lines)


def _range(r) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}–{r[1]}"


def _images_desc(wl: dict) -> str:
    res = ", ".join(f"{w}x{h}" for w, h in wl["resolutions"])
    per = {"text": "none", "image": "1 per request"}.get(wl["kind"], f"{_range(wl['images'])} per "
                                                      + ("turn" if wl["kind"] == "multiturn" else "request"))
    if per == "none":
        return per
    extra = f", pool {wl['pool_size']} at reuse {wl['reuse_ratio']}" if wl["kind"] == "reuse" else ""
    extra += f", {wl['turns']} turns, window {wl['window']}" if wl["kind"] == "multiturn" else ""
    return f"{per} ({wl['image_format']}, {res}{extra})"


def _breakdown_md(runs: list[dict]) -> list[str]:
    shown = [r for r in runs if r["target"].startswith("fleet:") or r["spans"].get("available")]
    if not shown:
        return []
    out = ["## Per-stage breakdown", "",
           "Fleets: from each request's terminal `Finish` event (`spans`): queue = upstream produce → the "
           "stage picks it up; transfer = NIXL pulls / puts and media fetches; compute = total − transfer. "
           "`inproc`: the same steps timed inside the one process (queue = waiting for a generation slot). "
           "In `epd` the prefill stage also decodes. Means / medians in ms.", ""]
    base = {r["label"]: r["spans"] for r in runs if r["target"] == "inproc" and r["spans"].get("available")}
    for r in sorted(shown, key=lambda r: (r["label"], r["target"])):
        sp = r["spans"]
        out.append(f"### `{r['target']}` at {r['label']}")
        out.append("")
        if not sp.get("available"):
            out += [f"No breakdown: {sp.get('reason')}.", ""]
            continue
        out += ["| stage | n | queue mean | queue p50 | transfer mean | transfer p50 | compute mean | compute p50 "
                "| total mean | total p50 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for stage, st in sp["stages"].items():
            cells = [_fmt(st[f].get(s)) for f in ("queue_ms", "transfer_ms", "compute_ms", "total_ms")
                     for s in ("mean", "p50")]
            out.append(f"| {stage} | {st['n']} | " + " | ".join(cells) + " |")
        per, b = sp["per_request_ms"], sp["biggest"]
        out += ["", f"Per request (means summed over stages): **{per['queue_ms'] + per['transfer_ms']:.1f} ms in "
                    f"hops** (queued {per['queue_ms']:.1f}, transfers {per['transfer_ms']:.1f}), "
                    f"{per['compute_ms']:.1f} ms computing. Biggest hop cost: **{b['stage']} "
                    f"{b['part'].removesuffix('_ms')}**, {b['mean_ms']:.1f} ms mean.", ""]
        if r["target"] != "inproc" and r["label"] in base:
            out += [_versus(sp, base[r["label"]]), ""]
    return out


def _versus(fleet: dict, inproc: dict) -> str:
    """One line: each stage's queue + total (mean ms) in the fleet against the same step in
    ``inproc``, and the stage where the fleet loses most."""
    def cost(sp: dict) -> dict[str, float]:
        return {st: v["queue_ms"]["mean"] + v["total_ms"]["mean"] for st, v in sp["stages"].items()}

    f, b = cost(fleet), cost(inproc)
    if "decode" not in f and "prefill" in f and "decode" in b:  # epd: its prefill stage decodes too
        b["prefill"] = b.get("prefill", 0.0) + b.pop("decode")
    pairs = [(st, f[st], b[st]) for st in f if st in b]
    if not pairs:
        return ""
    worst = max(pairs, key=lambda p: p[1] - p[2])
    return ("Against `inproc` (queue + total per stage, mean ms): "
            + ", ".join(f"{st} {fv:.1f} vs {bv:.1f} ({fv - bv:+.1f})" for st, fv, bv in pairs)
            + f". The fleet loses most in **{worst[0]}** ({worst[1] - worst[2]:+.1f} ms).")


def write_plots(runs: list[dict], out_dir: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install -e '.[bench]')"
    written = []
    for label in dict.fromkeys(r["label"] for r in runs):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for r in (r for r in runs if r["label"] == label):
            ok = [x for x in r["records"] if x["status"] == 200 and x["error"] is None]
            for ax, metric in zip(axes, ("ttft_ms", "e2e_ms"), strict=True):
                xs = sorted(x[metric] for x in ok if x[metric] is not None)
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r["target"])
        for ax, title in zip(axes, ("TTFT", "end-to-end latency"), strict=True):
            ax.set(title=f"{title} CDF at {label}", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        name = f"cdf_{_slug(label)}.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    sweeps = {}
    for r in runs:
        sweeps.setdefault((r["target"], r["shape"]["kind"]), []).append(r)
    # a sweep is two or more load levels (runs at one level, e.g. the reuse suite's, are not)
    sweeps = {k: v for k, v in sweeps.items() if len({r["shape"]["value"] for r in v}) >= 2}
    if sweeps:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for (target, kind), rs in sweeps.items():
            rs = sorted(rs, key=lambda r: r["shape"]["value"])
            xs = [r["shape"]["value"] for r in rs]
            axes[0].plot(xs, [r["aggregates"]["output_throughput"] for r in rs], marker="o", label=f"{target} ({kind})")
            axes[1].plot(xs, [_stat(r["aggregates"], "ttft_ms", "p50") or float("nan") for r in rs], marker="o",
                         label=f"{target} ({kind})")
        axes[0].set(title="output throughput vs load", xlabel="concurrency or request rate (/s)", ylabel="tokens/s")
        axes[1].set(title="TTFT p50 vs load", xlabel="concurrency or request rate (/s)", ylabel="ms")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_load.png", dpi=110)
        plt.close(fig)
        written.append("throughput_vs_load.png")
    written += ttft_split.plot(runs, out_dir, plt)
    return ", ".join(f"`{w}`" for w in written)
