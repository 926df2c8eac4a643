"""The standard suite (``python -m loadtest suite``; ``engines``, which ``make bench`` runs, adds to it).

One-image requests (http delivery from the local media server) at low load (concurrency 1)
and at saturation (concurrency 8), against ``fleet:e-p-d``, ``fleet:epd``, ``inproc`` and
``vllm-serve`` (skipped with its reason where vllm is missing), then the goals as met / not met:
- fleet TTFT p50 − inproc TTFT p50 ≤ 10 ms at low load;
- fleet output throughput ≥ 0.9 × inproc at saturation;
- fleet TTFT p50 ≤ 1.1 × vllm-serve TTFT p50 (at each load).
Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

from loadtest.loadgen import LoadShape
from loadtest.workloads import WorkloadConfig

TARGETS = ["fleet:e-p-d", "fleet:epd", "inproc", "vllm-serve"]
LOW, SAT = 1, 8


def suite_workload(n_requests: int) -> WorkloadConfig:
    return WorkloadConfig(kind="image", num_requests=n_requests, seed=0, max_tokens=(32, 32), text_words=(8, 16),
                          resolutions=((224, 224), (448, 336)), image_format="png")


def suite_shapes(low_requests: int, sat_requests: int, duration_s: float) -> list[LoadShape]:
    return [LoadShape("concurrency", LOW, low_requests, duration_s=duration_s, grace_s=30),
            LoadShape("concurrency", SAT, sat_requests, duration_s=duration_s, grace_s=30)]


def _agg(result: dict, target: str, label: str) -> dict | None:
    for r in result["runs"]:
        if r["target"] == target and r["label"] == label and r["aggregates"]["ok"]:
            return r["aggregates"]
    return None


def _why_missing(result: dict, target: str) -> str:
    why = result.get("skipped", {}).get(target) or result.get("failed", {}).get(target)
    return f"not evaluated: `{target}` {'skipped' if target in result.get('skipped', {}) else 'did not run'}" + (
        f" ({why.splitlines()[0][:160]})" if why else "")


def evaluate_goals(result: dict, *, low: str = f"c={LOW}", sat: str = f"c={SAT}") -> list[dict]:
    """One row per (goal, fleet target): ``{goal, measured, verdict}``; verdict is "met",
    "**not met**" or "not evaluated: ..." when a side is missing."""
    fleets = [t for t in result["config"]["targets"] if t.startswith("fleet:")]
    rows = []
    for f in fleets:
        fl, fs = _agg(result, f, low), _agg(result, f, sat)
        il, is_ = _agg(result, "inproc", low), _agg(result, "inproc", sat)
        goal = f"`{f}` TTFT p50 − `inproc` TTFT p50 ≤ 10 ms at {low}"
        if fl and il:
            d = fl["ttft_ms"]["p50"] - il["ttft_ms"]["p50"]
            rows.append({"goal": goal,
                         "measured": f"{fl['ttft_ms']['p50']:.1f} − {il['ttft_ms']['p50']:.1f} = {d:+.1f} ms",
                         "verdict": _verdict(d <= 10)})
        else:
            rows.append({"goal": goal, "measured": "–", "verdict": _why_missing(result, f if not fl else "inproc")})
        goal = f"`{f}` output throughput ≥ 0.9 × `inproc` at {sat}"
        if fs and is_:
            ratio = fs["output_throughput"] / is_["output_throughput"] if is_["output_throughput"] else float("nan")
            rows.append({"goal": goal, "measured": f"{fs['output_throughput']:.1f} / {is_['output_throughput']:.1f} "
                                                   f"tok/s = {ratio:.2f}×", "verdict": _verdict(ratio >= 0.9)})
        else:
            rows.append({"goal": goal, "measured": "–", "verdict": _why_missing(result, f if not fs else "inproc")})
        for label in (low, sat):
            goal = f"`{f}` TTFT p50 ≤ 1.1 × `vllm-serve` TTFT p50 at {label}"
            fa, va = _agg(result, f, label), _agg(result, "vllm-serve", label)
            if fa and va:
                ratio = fa["ttft_ms"]["p50"] / va["ttft_ms"]["p50"]
                rows.append({"goal": goal, "measured": f"{fa['ttft_ms']['p50']:.1f} / {va['ttft_ms']['p50']:.1f} ms "
                                                       f"= {ratio:.2f}×", "verdict": _verdict(ratio <= 1.1)})
            else:
                rows.append({"goal": goal, "measured": "–",
                             "verdict": _why_missing(result, f if not fa else "vllm-serve")})
    return rows


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"
