"""What a forward costs when its process comes to it cold, in one process: ``python -m loadtest cold``.

The engine's own prefill forward of a ``--prompt-tokens`` text prompt, in thread CPU time, under
five conditions taking turns forward by forward: ``hot`` (back to back), ``idle`` (after a
``--idle-ms`` sleep), ``busy`` (after a ``--idle-ms`` busy-wait), ``pressure`` (after untimed
work: ``--pressure-bytes`` of memory read and a 20,000-entry dict built and dropped) and
``idle+pressure``. Medians and ranges over ``--repeats``, and each condition's CPU over the same
repeat's ``hot`` (``vs_hot``). Why: at concurrency 1 every fleet stage wakes to a cold process,
while the one-process server runs its stages back to back. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from loadtest.repeats import spread

CONDITIONS = ("hot", "idle", "busy", "pressure", "idle+pressure")


class _Pressure:
    """Work that evicts what the forward left in the caches: a buffer read end to end, and a
    burst of Python allocations (what another process's event loop leaves behind)."""

    def __init__(self, nbytes: int) -> None:
        self._buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)

    def __call__(self) -> None:
        self._buf.sum()
        churn = {i: str(i) for i in range(20_000)}
        del churn


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed(forward) -> tuple[float, float]:
    c0, w0 = time.thread_time(), time.perf_counter()
    forward()
    return (time.thread_time() - c0) * 1000, (time.perf_counter() - w0) * 1000


def _one_repeat(forward, forwards: int, idle_s: float, pressure: _Pressure) -> dict[str, dict]:
    """``forwards`` timed forwards per condition, the conditions taking turns forward by forward
    (so that the machine's drift, large on a shared VM, falls on all of them alike). Each timed
    forward follows an untimed one, then the condition's prelude (nothing, a sleep, a busy-wait,
    other work)."""
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in CONDITIONS}
    for _ in range(forwards):
        for c in CONDITIONS:
            forward()
            if "pressure" in c:
                pressure()
            if "idle" in c:
                time.sleep(idle_s)
            elif c == "busy":
                _busy_wait(idle_s)
            times[c].append(_timed(forward))
    out = {c: {"cpu_ms": statistics.median(t[0] for t in ts), "wall_ms": statistics.median(t[1] for t in ts)}
           for c, ts in times.items()}
    for run in out.values():  # against this repeat's hot forwards: the machine's speed moves between repeats
        run["vs_hot"] = run["cpu_ms"] / out["hot"]["cpu_ms"]
    return out


def measure(compute, *, prompt_tokens: int, forwards: int, repeats: int, idle_ms: float,
            pressure_bytes: int) -> dict:
    """Per condition: ``cpu_ms``, ``wall_ms`` (median of a repeat's forwards) and ``vs_hot`` (that
    over the same repeat's ``hot`` CPU); median, min and max over the repeats."""
    vocab = int(compute.model.config.get_text_config().vocab_size)
    ids = [(7 * i + 11) % (vocab - 1) + 1 for i in range(prompt_tokens)]  # plain text tokens, no media
    pressure = _Pressure(pressure_bytes)

    def forward() -> None:
        compute.prefill(ids, [])

    with torch.inference_mode():
        for _ in range(3):
            forward()  # first-call costs (allocator, lazy init) are not what this measures
        runs: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
        for _ in range(repeats):
            for c, run in _one_repeat(forward, forwards, idle_ms / 1000, pressure).items():
                runs[c].append(run)
    by_condition = {c: spread(rs) for c, rs in runs.items()}
    return {"prompt_tokens": prompt_tokens, "forwards": forwards, "repeats": repeats, "idle_ms": idle_ms,
            "pressure_bytes": pressure_bytes, "conditions": list(CONDITIONS), "by_condition": by_condition,
            "runs": runs}


def markdown(res: dict) -> str:
    def cell(x: dict) -> str:
        return f"{x['median']:.2f} [{x['min']:.2f}–{x['max']:.2f}]"

    rows = ["| before each forward | CPU (ms) | wall (ms) | CPU ÷ hot, same repeat |", "|---|---:|---:|---:|"]
    what = {"hot": "nothing (back to back)", "idle": f"a {res['idle_ms']:g} ms sleep",
            "busy": f"a {res['idle_ms']:g} ms busy-wait (no sleep)",
            "pressure": f"other work ({res['pressure_bytes'] // 2**20} MiB read, 20k objects)",
            "idle+pressure": "other work, then the sleep"}
    for c in res["conditions"]:
        x = res["by_condition"][c]
        rows.append(f"| {what[c]} | {cell(x['cpu_ms'])} | {cell(x['wall_ms'])} | {cell(x['vs_hot'])} |")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, default=None, help="a built model (default: the demo model)")
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--forwards", type=int, default=60, help="timed forwards per condition and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-ms", type=float, default=50.0, help="the sleep (idle) or busy-wait (busy) "
                   "before each forward")
    p.add_argument("--pressure-bytes", type=int, default=8 * 2**20, help="memory read before each forward "
                   "under pressure (more than the core's L2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a fleet worker runs 1)")
    p.add_argument("--out", type=Path, default=None, help="write cold.json here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from loadtest.procs import model_dir
    from shared.engines.transformers_engine import compute_class
    from shared.models.loading import LM

    if args.forwards < 1 or args.repeats < 1 or args.idle_ms < 0 or args.pressure_bytes < 0:
        raise SystemExit("--forwards and --repeats: at least 1; --idle-ms and --pressure-bytes: not negative")
    torch.set_num_threads(args.threads)
    model_dir = model_dir(args.model_dir)
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    res = measure(compute, prompt_tokens=args.prompt_tokens, forwards=args.forwards, repeats=args.repeats,
                  idle_ms=args.idle_ms, pressure_bytes=args.pressure_bytes)
    res["model_dir"] = str(model_dir)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cold.json").write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"a {res['prompt_tokens']}-token prefill forward; median [min–max] of {res['repeats']} repeats, "
              f"{res['forwards']} forwards each\n")
        print(markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadtest cold", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
