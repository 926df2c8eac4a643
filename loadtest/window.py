"""The sliding-window suite (``python -m loadtest window``, ``mmfleet bench window``): users
each sending ``turns`` turns in sequence, every turn one message with the last ``window`` images
(the oldest out, one new in), against the fleet (transformers and vLLM engines), the fleet with
the embedding cache off and ``vllm serve``, side by side: every target up at once, measured one
at a time (:mod:`loadtest.interleave`), ``repeats`` rounds in rotating order, fresh seeded images
each round, the same for every target. Per target: RPS, TTFT p50/p90/p99/mean, ITL, encoder
items per request, the cache's hit rate and where a cold turn's and a follow-up's TTFT goes;
goals against ``vllm serve`` on the medians. ``--vllm-client`` replays the same requests with
vLLM's own client. Design: docs/benchmarks/window.md.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from loadtest import cpu as cpu_stats
from loadtest import ttft_split, window_dataset, workloads
from loadtest.bench import BenchConfig, _run_target
from loadtest.interleave import Interleaved, warm_requests
from loadtest.loadgen import LoadShape
from loadtest.reuse import _encoded
from loadtest.targets import TargetOptions

FLEET, FLEET_VLLM, FLEET_OFF, VLLM = ("fleet:e-p-d", "fleet:e-p-d,engine=vllm",
                                      "fleet:e-p-d,embedding_cache_bytes=0", "vllm-serve")
TARGETS = [FLEET, FLEET_VLLM, FLEET_OFF, VLLM]
# the fleet against vllm serve, medians over repeats (Dynamo's own margins on a GPU: 0.13x, 0.34x)
GOALS = (("ttft_ms:p50", "≤", 0.25), ("ttft_ms:mean", "≤", 0.5), ("ttft_ms:p90", "≤", 1.0),
         ("request_throughput", "≥", 2.0))


def default_workload(users: int = 4, turns: int = 6, window: int = 4, side: int = 448, words: int = 40,
                     max_tokens: int = 16, seed: int = 0) -> workloads.WorkloadConfig:
    return workloads.WorkloadConfig(kind="sliding-window", num_requests=users * turns, seed=seed,
                                    max_tokens=(max_tokens, max_tokens), text_words=(words, words), images=(1, 1),
                                    resolutions=((side, side),), turns=turns, window=window)


def shape(users: int, n_requests: int, duration_s: float = 300) -> LoadShape:
    return LoadShape("sessions", users, n_requests, duration_s=duration_s, grace_s=60)


def run_window(cfg: BenchConfig, opts: TargetOptions, repeats: int = 3, vllm_client: bool = False) -> dict:
    """Every target on the same requests, ``repeats`` rounds (seed + 1000·round), the order
    rotating. ``cfg.shapes``: one sessions shape; ``cfg.workload``: a sliding-window workload."""
    [sh] = cfg.shapes
    result: dict = {"config": {**cfg.to_dict(), "repeats": repeats}, "runs": [], "skipped": {}, "failed": {},
                    "targets": {}, "vllm_client": {}, "load_average_1m": {"start": os.getloadavg()[0]}}
    warm = warm_requests(cfg)
    with ExitStack() as stack:
        side = Interleaved(stack, cfg, opts, result, warm)
        side.open_all()
        for rep in range(repeats):
            wl = replace(cfg.workload, seed=cfg.workload.seed + 1000 * (rep + 1))
            specs = workloads.build(wl)
            for spec, _ep in side.rotated(rep):
                with side.running(spec) as ep:
                    asyncio.run(_run_target(ep, replace(cfg, shapes=[]), [], warm, None))  # consumers rejoin
                    before = _encoded(ep)
                    [run] = asyncio.run(_run_target(ep, cfg, [specs], [], None))
                    after = _encoded(ep)
                    run.update(label=f"{sh.label} #{rep + 1}", repeat=rep, load_average_1m=os.getloadavg()[0],
                               # the fleet-wide count is the cache index's: with the cache off it stays 0
                               # (every item is encoded then), so it is not reported there
                               encoder_items=None if before is None or after is None or "embedding_cache_bytes=0"
                               in spec else after - before,
                               image_slots=sum(len(s.images) for s in specs), turns=[s.turn for s in specs])
                    result["runs"].append(run)
        if vllm_client:  # once per target, on the last round's requests (new to every target)
            wl = replace(cfg.workload, seed=cfg.workload.seed + 1000 * (repeats + 1))
            specs = workloads.build(wl)
            dataset = window_dataset.write(specs, cfg.out_dir / "vllm-client-dataset")
            for spec, _ep in side.rotated(0):
                with side.running(spec) as ep:
                    result["vllm_client"][spec] = window_dataset.run_client(
                        ep, dataset, model=cfg.model, tokenizer=opts.model_dir, users=int(sh.value),
                        num_prompts=len(specs), output_len=cfg.workload.max_tokens[1],
                        out_dir=cfg.out_dir, tag="")
    result["load_average_1m"]["end"] = os.getloadavg()[0]
    return result


def _value(run: dict, what: str) -> float | None:
    agg = run["aggregates"]
    if what in ("request_throughput", "output_throughput"):
        return agg[what]
    metric, stat = what.split(":")
    return agg.get(metric, {}).get(stat)


def _turn_ttft(run: dict, cold: bool, stat: str = "p50") -> float | None:
    xs = [r["ttft_ms"] for r in run["records"] if r["ttft_ms"] is not None and r["error"] is None
          and (run["turns"][r["index"] % len(run["turns"])] == 0) == cold]
    if not xs:
        return None
    return statistics.median(xs) if stat == "p50" else max(xs)


def spread(xs: list[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the repeats' values."""
    vals = [x for x in xs if x is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def per_target(result: dict) -> dict[str, dict]:
    """Each target's figures over its repeats: ``{metric: (median, min, max)}`` plus the split."""
    out: dict[str, dict] = {}
    for target in dict.fromkeys(r["target"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["target"] == target and r["aggregates"]["ok"]]
        if not runs:
            continue
        row = {what: spread([_value(r, what) for r in runs]) for what in
               ("request_throughput", "output_throughput", "ttft_ms:p50", "ttft_ms:p90", "ttft_ms:p99",
                "ttft_ms:mean", "itl_ms:p50")}
        row["cold_ttft_ms:p50"] = spread([_turn_ttft(r, True) for r in runs])
        row["followup_ttft_ms:p50"] = spread([_turn_ttft(r, False) for r in runs])
        items = [(r["encoder_items"], r["aggregates"]["requests"], r["image_slots"]) for r in runs
                 if r.get("encoder_items") is not None]
        row["encoder_items_per_request"] = spread([e / n for e, n, _ in items]) if items else None
        row["hit_rate"] = spread([1 - e / s for e, _, s in items if s]) if items else None
        row["errors"] = sum(r["aggregates"]["failed"] for r in result["runs"] if r["target"] == target)
        row["split"] = {kind: _split([rec for r in runs for rec in r["records"]
                                      if (r["turns"][rec["index"] % len(r["turns"])] == 0) == (kind == "cold")])
                        for kind in ("cold", "follow-up")}
        out[target] = row
    return out


def _split(records: list[dict]) -> dict[str, float] | None:
    """Mean TTFT parts (ms) over a fleet's records (:mod:`loadtest.ttft_split`)."""
    parts = [p for p in (ttft_split.split_fleet(r) for r in records) if p]
    if not parts:
        return None
    return {k: sum(p[k] for p in parts) / len(parts) for k in ttft_split.PARTS} | {"n": len(parts)}


def goals(rows: dict[str, dict], fleet: str = FLEET, baseline: str = VLLM) -> list[dict]:
    a, b = rows.get(fleet), rows.get(baseline)
    out = []
    for what, op, limit in GOALS:
        name = f"`{fleet}` {what.replace('ttft_ms:', 'TTFT ').replace('request_throughput', 'RPS')} {op} " \
               f"{limit:g}× `{baseline}`'s"
        if not (a and b and a.get(what) and b.get(what) and b[what][0]):
            out.append({"goal": name, "measured": "–", "verdict": "not evaluated: a side did not run"})
            continue
        ratio = a[what][0] / b[what][0]
        met = ratio <= limit if op == "≤" else ratio >= limit
        out.append({"goal": name, "measured": f"{a[what][0]:.1f} vs {b[what][0]:.1f} = {ratio:.2f}×",
                    "verdict": "met" if met else "**not met**"})
    return out


def _fr(x, digits: int = 0) -> str:
    if x is None:
        return "–"
    med, lo, hi = x
    return f"{med:.{digits}f}" if lo == hi else f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


COLUMNS = ["target", "RPS", "TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "TTFT mean (ms)",
           "cold turn TTFT p50 (ms)", "follow-up TTFT p50 (ms)", "ITL p50 (ms)", "encoder items / request",
           "cache hit rate", "errors"]


def table_rows(rows: dict[str, dict]) -> list[list[str]]:
    return [[f"`{t}`", _fr(r["request_throughput"], 2), _fr(r["ttft_ms:p50"]), _fr(r["ttft_ms:p90"]),
             _fr(r["ttft_ms:p99"]), _fr(r["ttft_ms:mean"]), _fr(r["cold_ttft_ms:p50"]),
             _fr(r["followup_ttft_ms:p50"]), _fr(r["itl_ms:p50"], 1), _fr(r["encoder_items_per_request"], 2),
             "–" if r["hit_rate"] is None else f"{r['hit_rate'][0]:.0%}", str(r["errors"])]
            for t, r in rows.items()]


def split_rows(rows: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """Where a cold turn's and a follow-up's TTFT goes (mean ms), one row per fleet and kind."""
    cols = ["target", "turn", *ttft_split.PARTS, "requests"]
    out = []
    for t, r in rows.items():
        for kind, parts in r["split"].items():
            if parts:
                out.append([f"`{t}`", kind, *(f"{parts[k]:.0f}" for k in ttft_split.PARTS), str(parts["n"])])
    return cols, out


CPU_COLUMNS = ["target", "process", "CPU ms / request", "of it model compute", "cores busy"]


def cpu_rows(result: dict) -> list[list[str]]:
    """Each target's CPU milliseconds per finished request by process (user + system, median
    (min–max) over its rounds), heaviest first, with the part its compute lanes spent (the model's
    work; the rest is messaging, HTTP, tokenizing), then all of them with the share of the machine's
    cores they kept busy: a target that keeps the cores busy serves about cores ÷ its CPU a request."""
    cores = os.cpu_count() or 1
    out = []
    for target in dict.fromkeys(r["target"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["target"] == target and r["aggregates"].get("ok")
                and (r.get("cpu") or {}).get("by_process_s")]
        if not runs:
            continue

        def per_request(r: dict, role: str | None, compute: bool = False) -> float:
            cpu = r["cpu"]
            if compute:
                threads = cpu.get("by_thread_s") or {}
                sec = sum(t.get(cpu_stats.COMPUTE, 0) for k, t in threads.items() if role is None or k == role)
            else:
                sec = sum(cpu["by_process_s"].values()) if role is None else cpu["by_process_s"].get(role, 0)
            return 1000 * sec / r["aggregates"]["ok"]

        roles = sorted({role for r in runs for role in r["cpu"]["by_process_s"]},
                       key=lambda role: -statistics.median(per_request(r, role) for r in runs))
        with_threads = all(r["cpu"].get("by_thread_s") for r in runs)
        for role in [*roles, None]:
            ms = spread([per_request(r, role) for r in runs])
            if role is not None and ms[2] < 0.5:
                continue
            model = spread([per_request(r, role, compute=True) for r in runs]) if with_threads else None
            busy = spread([sum(r["cpu"]["by_process_s"].values()) / r["cpu"]["window_s"] / cores for r in runs
                           if r["cpu"].get("window_s")]) if role is None else None
            out.append([f"`{target}`", role or "**all**", _fr(ms), "–" if not model or not model[2] else _fr(model),
                        "" if role is not None else "–" if busy is None else f"{busy[0]:.0%}"])
    return out


def client_rows(theirs: dict) -> list[list[str]]:
    keys = ("request_throughput", "median_ttft_ms", "p90_ttft_ms", "mean_ttft_ms", "median_itl_ms", "failed")
    out = []
    for t, res in theirs.items():
        if "error" in res:
            out.append([f"`{t}`", *["–"] * (len(keys) - 1), res["error"][:80]])
            continue
        out.append([f"`{t}`", *(("–" if res.get(k) is None else f"{res[k]:.2f}" if k == "request_throughput"
                                 else f"{res[k]:.0f}") for k in keys)])
    return out


def _md(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(r) + " |" for r in rows)]


def summary_md(result: dict) -> list[str]:
    rows = per_target(result)
    cfg = result["config"]
    wl = cfg["workload"]
    users = cfg["shapes"][0]["value"]
    lines = ["## Sliding image window", "",
             f"{int(users)} users × {wl['turns']} turns in sequence, a window of {wl['window']} images of "
             f"{wl['resolutions'][0][0]}×{wl['resolutions'][0][1]} (one new a turn), {wl['text_words'][0]} words, "
             f"{wl['max_tokens'][0]} tokens out; median (min–max) over {cfg['repeats']} rounds, targets "
             "interleaved.", "", *_md(COLUMNS, table_rows(rows)), ""]
    cols, srows = split_rows(rows)
    if srows:
        lines += ["### Where TTFT goes (mean ms)", "", *_md(cols, srows), ""]
    crows = cpu_rows(result)
    if crows:
        lines += ["### CPU per request", "", *_md(CPU_COLUMNS, crows), ""]
    fleet = cfg["targets"][0]
    lines += ["### Goals", "", *_md(["goal", "measured", "verdict"],
                                    [[g["goal"], g["measured"], g["verdict"]] for g in goals(rows, fleet)]), ""]
    if result.get("vllm_client"):
        lines += ["### vLLM's client (`custom_image`, the same requests)", "",
                  *_md(["target", "RPS", "TTFT p50", "TTFT p90", "TTFT mean", "ITL p50", "failed"],
                       client_rows(result["vllm_client"])), ""]
    return lines


def plot(result: dict, out_dir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = per_target(result)
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (what, title) in zip(axes, (("ttft_ms:p50", "TTFT p50 (ms)"), ("ttft_ms:p90", "TTFT p90 (ms)"),
                                        ("request_throughput", "requests/s")), strict=True):
        med = [rows[n][what][0] if rows[n][what] else 0 for n in names]
        err = [[m - (rows[n][what][1] if rows[n][what] else 0) for m, n in zip(med, names)],
               [(rows[n][what][2] if rows[n][what] else 0) - m for m, n in zip(med, names)]]
        ax.barh(names, med, xerr=err, color="tab:blue", capsize=3)
        ax.set_title(title + " (median, min–max)")
        ax.invert_yaxis()
    fig.tight_layout()
    path = out_dir / "window.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_records(result: dict, out: Path, command: str, rid: str = "window-bench-model") -> Path:
    """The run as one docs record (``out/records/<rid>.json``): the targets, where TTFT goes, the
    goals and, when it ran, vLLM's client; copy it to docs/benchmarks/results/ to publish."""
    from loadtest.gpu_vllm_common import commit, write_record

    rows = per_target(result)
    cfg, wl = result["config"], result["config"]["workload"]
    cols, srows = split_rows(rows)
    tables = [{"name": "targets", "columns": COLUMNS, "rows": table_rows(rows)},
              {"name": "split", "columns": cols, "rows": srows},
              {"name": "cpu", "columns": CPU_COLUMNS, "rows": cpu_rows(result)},
              {"name": "goals", "columns": ["goal", "measured", "verdict"],
               "rows": [[g["goal"], g["measured"], g["verdict"]] for g in goals(rows, cfg["targets"][0])]}]
    if result.get("vllm_client"):
        tables.append({"name": "vllm-client", "columns": ["target", "RPS", "TTFT p50 (ms)", "TTFT p90 (ms)",
                                                          "TTFT mean (ms)", "ITL p50 (ms)", "failed"],
                       "rows": client_rows(result["vllm_client"])})
    la = result.get("load_average_1m", {})
    conditions = (f"{int(cfg['shapes'][0]['value'])} users × {wl['turns']} turns, each user's turns in sequence; "
                  f"every request one message with the last {wl['window']} images of "
                  f"{wl['resolutions'][0][0]}² (one new a turn: {wl['window'] - 1} of {wl['window']} seen before), "
                  f"{wl['text_words'][0]} words, {wl['max_tokens'][0]} tokens out, temperature 0. Targets up "
                  f"together, measured one at a time (the others SIGSTOPped), {cfg['repeats']} rounds in rotating "
                  f"order, fresh images each round; median (min–max) over the rounds. Load average (1 min) "
                  f"{la.get('start', 0):.2f} at start, {la.get('end', 0):.2f} at the end.")
    return write_record(out, rid, title="Sliding image windows: the fleet against vllm serve, bench model",
                        command=command, conditions=conditions, commit_hash=commit(), tables=tables,
                        plots=[{"table": "targets", "kind": "bar", "x": "target",
                                "y": ["TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT mean (ms)"],
                                "title": "Sliding image windows: TTFT by target", "ylabel": "ms"}])
