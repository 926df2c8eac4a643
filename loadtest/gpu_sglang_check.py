"""The SGLang GPU check (``make gpu-sglang-check``): the fleet with the SGLang engine on CUDA beside
SGLang's own server on the same GPU, on a model with Qwen2-VL-2B's shapes (random bf16 weights,
built there).

Phases, each its own process: build, preflight (imports, our ``sglang.Engine`` arguments as
SGLang's ``ServerArgs``, ``launch_server``'s and ``bench_serving``'s flags), offline (SGLang's
``Engine.generate`` answers), fleets (epd and e-pd answers; the e-pd fleet under
``bench_serving``), serve (``python -m sglang.launch_server`` under the same loads). One
docs-format record per figure under ``--out``/records, then a table. Without a GPU or without
SGLang it refuses at once, exit 2. Docs: docs/deploy/gpus.md ("Running the SGLang GPU check").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtest import gpu_sglang_phases as phases
from loadtest import gpu_vllm_check, gpu_vllm_plan, procs
from loadtest import gpu_vllm_common as common
from loadtest.gpu_vllm_common import Phase

PHASES: dict[str, Phase] = {
    "build": common.PHASES["build"],
    "preflight": Phase(40, 180, True, "imports, our Engine arguments as SGLang's ServerArgs, launch_server's and "
                                      "bench_serving's flags, the fleets' settings"),
    "offline": Phase(90, 300, True, "sglang.Engine.generate, greedy: text, one image (SGLang's processor), and the "
                                    "fleet encoder's embeddings of it through our mapping"),
    "fleets": Phase(240, 540, True, "epd and e-pd (engine sglang) answers = Engine.generate; e-pd under "
                                    "bench_serving (image and random, c=1 and 8)"),
    "serve": Phase(150, 420, True, "python -m sglang.launch_server: its answer, and the same bench_serving loads"),
}
ORDER = tuple(PHASES)
DOC = "'Running the SGLang GPU check'"
WHEELS = "sglang-trimmed"  # the list the device plan carries (loadtest/gpu_wheels.py: SGLANG)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_sglang_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    ap.add_argument("--out", type=Path, help="results folder (default loadtest/results/gpu-sglang-<time>)")
    ap.add_argument("--model-dir", type=Path, help="a Qwen2-VL folder (default: build the 2B-shaped one)")
    ap.add_argument("--cache-dir", type=Path, default=procs.REPO / ".mmfleet" / "cache" / "models")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture CUDA graphs in every engine and launch_server; default off (faster starts)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.25,
                    help="each SGLang engine's share of the GPU for weights and KV (the fleets' encoder shares it)")
    ap.add_argument("--context-length", dest="max_model_len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per parity prompt")
    ap.add_argument("--commit", help="the measured code's commit (default: git, else unknown)")
    ap.add_argument("--plan", action="store_true", help="print the timed device plan and exit")
    ap.add_argument("--dry-run", action="store_true", help="say what would run; refuse as usual without a GPU")
    ap.add_argument("--phase", choices=ORDER, help=argparse.SUPPRESS)  # one phase, in this process
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.phases = gpu_vllm_check.phase_list(_parser(), args.phases, ORDER)
    if not 0.0 < args.mem_fraction_static < 1.0:
        _parser().error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    args.out = args.out or common.RESULTS / time.strftime("gpu-sglang-%Y%m%d-%H%M%S")
    args.device = "cuda"  # SGLang has no CPU build; the shared phase helpers read it
    return args


def no_gpu_reason(environ: dict[str, str] | None = None) -> str | None:
    return gpu_vllm_check.no_gpu_reason(environ, engine="sglang")


def describe(args: argparse.Namespace) -> str:
    lines = [f"gpu-sglang-check: phases {', '.join(args.phases)}; results under {args.out}"]
    lines += [f"  {name:9} ~{PHASES[name].expected_s:>3} s (stopped at {PHASES[name].timeout_s} s): "
              f"{PHASES[name].what}" for name in args.phases]
    fleet = ",".join(f"{k}={v}" for k, v in phases.engine_settings(args).items())
    lines += [f"  fleets: fleet:epd,{fleet} and fleet:e-pd,{fleet}",
              f"  expected in all: ~{sum(PHASES[p].expected_s for p in args.phases)} s"]
    return "\n".join(lines)


PLAN = gpu_vllm_plan.Check(
    "SGLang GPU check", "loadtest.gpu_sglang_check", "/tmp/gpu-sglang",
    (("build", "preflight", "offline"), ("fleets", "serve")), PHASES,
    procs.REPO / ".whl" / f"calls-{WHEELS}", 10, flags=lambda args: " --cuda-graphs" if args.cuda_graphs else "",
    prepare=f"python -m loadtest.gpu_wheels prepare --list {WHEELS}", install_s=60)


def run_phase(name: str, args: argparse.Namespace) -> int:
    """One phase, in this process (the check runs each as ``--phase NAME``)."""
    from loadtest import gpu_sglang_serve, gpu_vllm_phases

    t0 = time.monotonic()
    if name != "build" and (md := gpu_vllm_phases.model_dir(args)) is not None:
        args = gpu_vllm_phases.fit(args, md)
    table = {"build": gpu_vllm_phases.build, "preflight": phases.preflight, "offline": phases.offline,
             "fleets": gpu_sglang_serve.fleets, "serve": gpu_sglang_serve.serve}
    ok = table[name](args)
    print(f"{name}: {'passed' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.phase:
        return run_phase(args.phase, args)
    if args.plan:
        print(gpu_vllm_plan.plan_text(args, check=PLAN))
        return 0
    print(describe(args), flush=True)
    why = no_gpu_reason()
    if why:
        print(f"gpu-sglang-check REFUSED: no GPU to check on: {why}. Nothing was started or built.", flush=True)
        return 2
    if args.dry_run:
        return 0
    argv_common = ["--out", str(args.out), "--cache-dir", str(args.cache_dir), "--mem-fraction-static",
                   str(args.mem_fraction_static), "--context-length", str(args.max_model_len), "--max-tokens",
                   str(args.max_tokens), "--commit", args.commit or common.commit(),
                   *(["--cuda-graphs"] if args.cuda_graphs else []),
                   *(["--model-dir", str(args.model_dir)] if args.model_dir else [])]
    return gpu_vllm_check.run_phases(args.out, args.phases, PHASES, "loadtest.gpu_sglang_check", argv_common, DOC)


if __name__ == "__main__":
    sys.exit(main())
