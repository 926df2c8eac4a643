"""The SGLang GPU check's fleets and serve phases. fleets: an epd and an e-pd fleet (engine sglang,
device cuda) answer the parity prompts as SGLang's offline ``Engine.generate`` (phase offline) did
(the text; the image is refused, 400, while ``ENGINE_SUPPORT`` serves Qwen-VL text only with
SGLang), then the e-pd fleet takes ``python -m sglang.bench_serving`` (backend sglang-oai-chat,
``image`` and ``random-ids``, c=1 and 8). serve: ``python -m sglang.launch_server`` with the fleet
engine's arguments answers the same prompts and takes the same loads. Records: fleets, client.
Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from loadtest import gpu_sglang_phases as phases
from loadtest import gpu_vllm_common as common
from loadtest import gpu_vllm_fleets as vfleets
from loadtest import gpu_vllm_phases as vphases
from loadtest import procs

MODEL = vfleets.MODEL
LEVELS = (1, 8)
PROMPTS_AT = {1: 8, 8: 32}
DATASETS = ("image", "random-ids")
IMAGE_SIDE = 448  # 256 LM tokens with Qwen2-VL's 14-px patches merged 2x2
INPUT_LEN, OUTPUT_LEN = 64, 64
REFUSED = "request failed: HTTP Error 400"


def _refs(args: argparse.Namespace) -> dict | None:
    path = args.out / "ref" / "refs.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _verdicts_ok(by_prompt: dict[str, str]) -> bool:
    """The text equal, the image refused with a 400 (not served with SGLang from embeddings)."""
    return by_prompt.get("text") == "equal" and by_prompt.get("one-image", "").startswith(REFUSED)


# ---------------------------------------------------------------- fleets
def fleets(args: argparse.Namespace) -> bool:
    from loadtest.targets import TargetOptions, Targets

    md, refs = vphases.model_dir(args), _refs(args)
    opts = TargetOptions(model_dir=md, log_dir=args.out / "logs", served_model_name=MODEL, ready_timeout_s=300)
    parity: dict[str, dict[str, str]] = {}
    ok = True
    with Targets(opts) as targets:
        for mode in ("epd", "e-pd"):
            try:
                with targets.open(phases.fleet_spec(mode, args)) as ep:
                    parity[mode] = vfleets.answers(ep.base_url, refs, args.max_tokens, phases.PROMPTS)
                    _parity_record(args, parity)
                    if mode == "e-pd":
                        ok = _client_runs(args, md, ep.base_url, "fleet e-pd (engine sglang)") and ok
            except Exception as exc:  # noqa: BLE001 - the other fleet still runs
                print(f"  fleet {mode} failed: {type(exc).__name__}: {exc}"[:600], flush=True)
                parity[mode] = {name: f"fleet failed: {type(exc).__name__}"[:100] for name in phases.PROMPTS}
    _parity_record(args, parity)
    return ok and all(_verdicts_ok(v) for v in parity.values())


# ---------------------------------------------------------------- serve
def serve(args: argparse.Namespace) -> bool:
    md, refs = vphases.model_dir(args), _refs(args)
    port = procs.free_port()
    log = args.out / "logs" / "launch_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    kwargs = phases.engine(md, args).server_args()
    argv = [sys.executable, "-m", "sglang.launch_server", *phases.server_flags(kwargs), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", MODEL]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = procs.spawn(argv, log_path=log, env={**_env(), "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, cwd=procs.REPO)
    try:
        procs.wait_http(base + "/v1/models", proc, 300, log)
        print(f"  launch_server up in {time.monotonic() - t0:.0f} s: {' '.join(argv[3:])}", flush=True)
        answers = vfleets.answers(base, refs, args.max_tokens, phases.PROMPTS)
        _parity_record(args, {**_load(args, "parity"), "launch_server": answers})
        ok = _client_runs(args, md, base, "sglang launch_server")
    finally:
        procs.stop_group(proc, timeout_s=30)
    # SGLang's own server takes the image from its own processor: both prompts must equal Engine.generate
    return ok and all(v == "equal" for v in answers.values())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------- bench_serving
def bench_argv(base_url: str, md: Path, dataset: str, concurrency: int, num_prompts: int, out_file: Path) -> list[str]:
    """``python -m sglang.bench_serving`` against an OpenAI chat endpoint: one PNG of 448² (dataset
    image) or none (random-ids), 64 random tokens in, 64 out (ignore_eos, its default)."""
    argv = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai-chat", "--base-url", base_url,
            "--dataset-name", dataset, "--model", MODEL, "--tokenizer", str(md), "--num-prompts", str(num_prompts),
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio",
            "1.0", "--max-concurrency", str(concurrency), "--output-file", str(out_file), "--seed", "0",
            "--warmup-requests", "1", "--disable-tqdm"]
    if dataset == "image":
        argv += ["--image-count", "1", "--image-resolution", f"{IMAGE_SIDE}x{IMAGE_SIDE}", "--image-format", "png"]
    return argv


def _client_runs(args: argparse.Namespace, md: Path, base_url: str, label: str) -> bool:
    """Every dataset at every level; each result kept in ``out/client.json`` as it comes."""
    ok = True
    for dataset in DATASETS:
        for c in LEVELS:
            slug = label.split(" (")[0].replace(" ", "-")
            out_file = args.out / "client" / f"{slug}-{dataset}-c{c}.jsonl"
            out_file.parent.mkdir(parents=True, exist_ok=True)
            log = args.out / "logs" / f"bench-{slug}-{dataset}-c{c}.log"
            with open(log, "wb") as fh:
                rc = subprocess.run(bench_argv(base_url, md, dataset, c, PROMPTS_AT[c], out_file), stdout=fh,
                                    stderr=subprocess.STDOUT, cwd=procs.REPO, env=_env(), timeout=300).returncode
            result = _last_line(out_file) if rc == 0 else {"error": f"exit {rc}: {procs.log_tail(log, 300)}"}
            runs = _load(args, "client")
            runs[f"{label}|{dataset}|{c}"] = result
            _save(args, "client", runs)
            _client_record(args, runs)
            print(f"  {label} {dataset} c={c}: " + ("failed" if "error" in result else
                  f"TTFT p50 {result.get('median_ttft_ms', 0):.1f} ms, {result.get('output_throughput', 0):.1f} "
                  "output tok/s"), flush=True)
            # the fleet refuses images with engine sglang: that dataset's failures are its verdict
            expected_refusal = dataset == "image" and label.startswith("fleet")
            ok = ok and (expected_refusal or ("error" not in result and result.get("completed") == PROMPTS_AT[c]))
    return ok


def _last_line(path: Path) -> dict:
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return json.loads(lines[-1]) if lines else {"error": "no result line"}


def _load(args: argparse.Namespace, what: str) -> dict:
    path = args.out / f"{what}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(args: argparse.Namespace, what: str, value: dict) -> None:
    (args.out / f"{what}.json").write_text(json.dumps(value, indent=1))


# ---------------------------------------------------------------- records
def _parity_record(args: argparse.Namespace, parity: dict[str, dict[str, str]]) -> None:
    parity = {**_load(args, "parity"), **parity}
    _save(args, "parity", parity)
    rows = [[target, name, verdict] for target, by in parity.items() for name, verdict in by.items()]
    if rows:
        common.write_record(
            args.out, f"gpu-{common.gpu_slug()}-sglang-fleets",
            title="SGLang-engine fleets and SGLang's server against SGLang's offline answers",
            command=phases.command(args), commit_hash=args.commit, conditions=phases.conditions(args, (
                "Each fleet (mmfleet up --mode M, engine sglang, device cuda, the harness's broker and Redis) and "
                "python -m sglang.launch_server (the fleet engine's arguments as flags) answer each prompt once "
                "(chat completion, temperature 0), the image as a PNG data URL. 'equal': the answer is the decoded "
                "text of sglang.Engine.generate (phase offline; the image through SGLang's own processor). The "
                "fleets refuse the image (400): they serve Qwen-VL text only with engine sglang.")),
            tables=[{"name": "parity", "columns": ["target", "prompt", "answer vs Engine.generate"], "rows": rows}])


def _client_record(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    rows = []
    for key, r in runs.items():
        target, dataset, c = key.split("|")
        rows.append([target, dataset, int(c)] + (["failed"] * 5 if "error" in r else [
            vfleets._ms(r.get("median_ttft_ms")), vfleets._ms(r.get("p99_ttft_ms")),
            vfleets._ms(r.get("median_tpot_ms")), vfleets._ms(r.get("output_throughput")),
            f"{r.get('completed', 0)} / {PROMPTS_AT[int(c)]}"]))
    common.write_record(
        args.out, f"gpu-{common.gpu_slug()}-sglang-client",
        title="The SGLang-engine fleet and sglang launch_server under SGLang's own client",
        command=phases.command(args), commit_hash=args.commit, conditions=phases.conditions(args, (
            "python -m sglang.bench_serving, backend sglang-oai-chat (/v1/chat/completions, streamed): dataset image "
            f"(one {IMAGE_SIDE}x{IMAGE_SIDE} PNG a request) and random-ids (text only), {INPUT_LEN} random tokens "
            f"in and {OUTPUT_LEN} out (ignore_eos), {PROMPTS_AT[1]} prompts at c=1 and {PROMPTS_AT[8]} at c=8, one "
            "warm-up request. The e-pd fleet (encode: transformers vision tower on the GPU; pd: the SGLang engine) "
            "and launch_server ran one after the other on the same GPU, each alone; the fleet refuses images with "
            "engine sglang, so its image rows fail by design.")),
        tables=[{"name": "client", "columns": ["target", "dataset", "concurrency", "TTFT p50 (ms)", "TTFT p99 (ms)",
                                               "TPOT p50 (ms)", "output tok/s", "completed / sent"], "rows": rows}])
