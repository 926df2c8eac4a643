"""A batched decode step's CPU cost by batch width, in one process: ``python -m loadtest steps``.

The engine's own ``decode_steps`` with its kept ``Stack``, in thread CPU time: for each width w of
``--widths``, w sequences of a ``--prompt-tokens`` prompt step together ``--steps`` times
(``step_ms``: the median), then ``--steps`` more with one member leaving and one joining before
each (``join_step_ms``: the stack rebuilt). ``per_seq_ms`` = step_ms / w, one token's cost at that
width. Widths interleaved, ``--repeats`` times; medians and ranges. Why: the fleet's decode core
and the in-process batcher step different numbers of sequences at once under the same load.
Design: docs/benchmarks/README.md.
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


def _median_cpu_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1000)
    return statistics.median(times)


def _one_width(compute, prefilled, width: int, steps: int) -> dict:
    from shared.engines.batched import Stack, decode_steps

    def new_state():
        return compute.start_decode(prefilled.kv.clone(), prefilled.rope_delta, prefilled.prompt_len)

    items = [(new_state(), 5) for _ in range(width)]
    stack = Stack()
    decode_steps(compute, items, stack)  # builds the stack; the timed steps find it built
    step_ms = _median_cpu_ms(lambda: decode_steps(compute, items, stack), steps)

    joining = [new_state() for _ in range(steps)]  # made beforehand: the step is timed, not the KV copy

    def join_step():
        items.append((joining.pop(), 5))  # joins; the oldest leaves: the stack no longer holds the set
        del items[0]
        decode_steps(compute, items, stack)

    join_ms = _median_cpu_ms(join_step, steps)
    return {"step_ms": step_ms, "join_step_ms": join_ms, "per_seq_ms": step_ms / width}


def measure(compute, *, widths: list[int], prompt_tokens: int, steps: int, repeats: int) -> dict:
    """Per width: ``step_ms``, ``join_step_ms``, ``per_seq_ms`` (median, min, max over repeats)."""
    vocab = int(compute.model.config.get_text_config().vocab_size)
    ids = [(7 * i + 11) % (vocab - 1) + 1 for i in range(prompt_tokens)]  # plain text tokens, no media
    with torch.inference_mode():
        prefilled = compute.prefill(ids, [])
        runs = {w: [] for w in widths}
        for _ in range(repeats):
            for w in widths:
                runs[w].append(_one_width(compute, prefilled, w, steps))
    by_width = {str(w): spread(rs) for w, rs in runs.items()}
    return {"prompt_tokens": prompt_tokens, "steps": steps, "repeats": repeats, "widths": widths,
            "by_width": by_width, "runs": {str(w): rs for w, rs in runs.items()}}


def markdown(res: dict) -> str:
    def cell(x: dict) -> str:
        return f"{x['median']:.2f} [{x['min']:.2f}–{x['max']:.2f}]"

    rows = ["| sequences a step | step (ms CPU) | per sequence (ms CPU) | step with a join (ms CPU) |",
            "|---:|---:|---:|---:|"]
    for w in res["widths"]:
        x = res["by_width"][str(w)]
        rows.append(f"| {w} | {cell(x['step_ms'])} | {cell(x['per_seq_ms'])} | {cell(x['join_step_ms'])} |")
    return "\n".join(rows)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    widths = res["widths"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("step_ms", "a step"), ("per_seq_ms", "per sequence"), ("join_step_ms", "a step with a join")):
        med = [res["by_width"][str(w)][key]["median"] for w in widths]
        lo = [m - res["by_width"][str(w)][key]["min"] for w, m in zip(widths, med, strict=True)]
        hi = [res["by_width"][str(w)][key]["max"] - m for w, m in zip(widths, med, strict=True)]
        ax.errorbar(widths, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xlabel("sequences stepped together")
    ax.set_ylabel("CPU ms (median, min–max)")
    ax.set_title(f"decode step cost, {res['prompt_tokens']}-token prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, default=None, help="a built model (default: the demo model)")
    p.add_argument("--widths", default="1,2,4,6,8", help="sequences stepped together, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=40, help="timed steps per width and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a fleet worker runs 1)")
    p.add_argument("--out", type=Path, default=None, help="write steps.json (and steps.png) here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from loadtest.procs import model_dir
    from shared.engines.transformers_engine import compute_class
    from shared.models.loading import LM

    torch.set_num_threads(args.threads)
    model_dir = model_dir(args.model_dir)
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    if not widths or min(widths) < 1:
        raise SystemExit("--widths: positive integers, e.g. 1,2,4,8")
    res = measure(compute, widths=widths, prompt_tokens=args.prompt_tokens, steps=args.steps, repeats=args.repeats)
    res["model_dir"] = str(model_dir)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "steps.json").write_text(json.dumps(res, indent=1))
        plot(res, args.out / "steps.png")
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['prompt_tokens']}-token prompts; median [min–max] of {res['repeats']} repeats, "
              f"{res['steps']} steps each\n")
        print(markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadtest steps", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
