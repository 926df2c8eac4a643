"""Repeated load levels side by side: per target, the median and spread (min–max) over
repetitions of TTFT p50 / p99, output tokens/s and the target's CPU (idle and under load),
and per repetition the fleet − inproc TTFT p50 and fleet / inproc throughput (a fleet's k-th
run against the baseline's k-th run), so one noisy repetition shows as spread, not as a figure.
Baseline: the target named exactly ``inproc`` when present.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

from statistics import median


def spread(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per key of the first run: the median, min and max of that key over ``runs`` (the in-process
    measurements' repeats, ``split`` and ``steps``)."""
    return {k: {"median": median(r[k] for r in runs), "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
            for k in runs[0]}


def _ttft(run: dict, stat: str):
    return run["aggregates"].get("ttft_ms", {}).get(stat)


def _med(xs: list, digits: int = 1) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{median(xs):.{digits}f} [{min(xs):.{digits}f}–{max(xs):.{digits}f}]"


def repeats_md(runs: list[dict]) -> list[str]:
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in runs:
        groups.setdefault(r.get("base_label", r["label"]), {}).setdefault(r["target"], []).append(r)
    if not groups:
        return []
    out = ["## Medians over repetitions (spread = min–max) and CPU", "",
           "CPU: percent of one core, the target's processes (fleets: + the broker and Redis the harness "
           "started); idle = before the first load level, no request in flight.", ""]
    for label, by_target in groups.items():
        n = max(len(v) for v in by_target.values())
        out += [f"### {label} ({n} repetition{'s' if n > 1 else ''})", "",
                "| target | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | CPU idle % | CPU under load % "
                "| TTFT p50 − inproc (ms) | tok/s ÷ inproc |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        base = by_target.get("inproc")
        for target, rs in by_target.items():
            d_ttft, ratio = [], []
            if base and target != "inproc":
                for r, b in zip(rs, base, strict=False):
                    if _ttft(r, "p50") is not None and _ttft(b, "p50") is not None:
                        d_ttft.append(_ttft(r, "p50") - _ttft(b, "p50"))
                    if b["aggregates"]["output_throughput"]:
                        ratio.append(r["aggregates"]["output_throughput"] / b["aggregates"]["output_throughput"])
            cpu = [r.get("cpu", {}) for r in rs]
            out.append(f"| `{target}` | {_med([_ttft(r, 'p50') for r in rs])} | {_med([_ttft(r, 'p99') for r in rs])} "
                       f"| {_med([r['aggregates']['output_throughput'] for r in rs])} "
                       f"| {_med([c.get('idle_pct') for c in cpu][:1])} | {_med([c.get('load_pct') for c in cpu])} "
                       f"| {_med(d_ttft)} | {_med(ratio, 2)} |")
        out.append("")
    return out
