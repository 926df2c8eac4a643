"""The vLLM GPU check's fleets phase: an epd fleet and an e-p-d fleet (engine vllm, device cuda)
answer the parity prompts exactly as vLLM's offline ``LLM.generate`` (phase ref); then the e-p-d
fleet and ``vllm serve``, one after the other on the same GPU and model, each take the harness's
sliding-window workload (``multiturn``, the last 2 images kept, our client) and vLLM's own
``vllm bench serve`` (random-mm, one 448² image, c=1 and 16). Three records. Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import urllib.request

from loadtest import gpu_vllm_common as common
from loadtest import gpu_vllm_phases as phases

MODEL = "mmfleet-demo"  # the served name every target answers to
CLIENT_LEVELS = (1, 16)
CLIENT_PROMPTS = {1: 12, 16: 48}
CPU_CLIENT_PROMPTS = {1: 2, 16: 4}  # the CPU rehearsal's
WINDOW_LEVELS = (1, 8)
WINDOW_REQUESTS = 16  # a level: 4 sessions x 4 turns


def fleet_spec(mode: str, args: argparse.Namespace) -> str:
    return f"fleet:{mode}," + ",".join(f"{k}={v}" for k, v in common.engine_settings(args).items())


def window_workload(args: argparse.Namespace, seed: int = 0):
    """Sessions of 4 turns, one new 448² image a turn, the conversation resent with its last 2
    images (older ones dropped): the prompt's prefix changes as the window slides (CPU: 224², 4
    requests of 8 tokens)."""
    from loadtest.workloads import WorkloadConfig

    cpu = args.device == "cpu"
    return WorkloadConfig(kind="multiturn", num_requests=4 if cpu else WINDOW_REQUESTS, seed=seed,
                          max_tokens=(8, 8) if cpu else (32, 32), text_words=(16, 24), images=(1, 1),
                          resolutions=((224, 224),) if cpu else ((448, 448),), turns=4, window=2)


def fleets(args: argparse.Namespace) -> bool:
    from loadtest import report, vllmclient
    from loadtest.bench import BenchConfig, run_bench
    from loadtest.loadgen import LoadShape
    from loadtest.targets import TargetOptions, Targets

    md = phases.model_dir(args)
    loaded = phases.load_refs(args.out)
    refs = loaded[0] if loaded else None
    opts = TargetOptions(model_dir=md, log_dir=args.out / "logs", served_model_name=MODEL,
                         vllm_serve_args=common.serve_args(args), ready_timeout_s=300)
    parity: dict[str, dict] = {}
    so_far: dict = {"after": {}, "runs": []}  # records are rewritten as figures arrive: a stopped run keeps them
    try:
        with Targets(opts) as targets, targets.open(fleet_spec("epd", args)) as ep:
            parity["epd"] = answers(ep.base_url, refs, args.max_tokens)
    except Exception as exc:  # noqa: BLE001 - the e-p-d fleet and vllm serve still run
        print(f"  fleet epd failed: {type(exc).__name__}: {exc}"[:600], flush=True)
        parity["epd"] = {name: f"fleet failed: {type(exc).__name__}"[:100] for name in phases.PROMPTS}
    _records(args, parity, so_far)

    def after(ep) -> dict:
        out = so_far["after"][ep.name] = {}
        if ep.name.startswith("fleet:"):
            out["parity"] = parity["e-p-d"] = answers(ep.base_url, refs, args.max_tokens)
            _records(args, parity, so_far)
        out["client"] = vllmclient.run_client(ep, model=MODEL, tokenizer=md, out_dir=args.out,
                                              num_prompts=CPU_CLIENT_PROMPTS if args.device == "cpu"
                                              else CLIENT_PROMPTS, concurrency=CLIENT_LEVELS,
                                              **phases.workload(args))
        _records(args, parity, so_far)
        return out

    wl = window_workload(args)
    cfg = BenchConfig(targets=[fleet_spec("e-p-d", args), "vllm-serve"], workload=wl,
                      shapes=[LoadShape("concurrency", c, wl.num_requests, duration_s=120, grace_s=60)
                              for c in WINDOW_LEVELS],
                      out_dir=args.out, model=MODEL, warmup=2, idle_cpu_s=1.0, progress=False)
    result = run_bench(cfg, opts, after=after)
    report.write_all(result, args.out, plots=False)
    for spec, why in {**result["skipped"], **result["failed"]}.items():
        print(f"  {spec}: {why[:400]}", flush=True)
    _records(args, parity, result)
    equal = all(v == "equal" for mode in parity.values() for v in mode.values())
    return equal and not result["failed"] and not result["skipped"] and len(parity) == 2


def answers(base_url: str, refs: dict | None, max_tokens: int, prompts: dict | None = None) -> dict[str, str]:
    """Each parity prompt's answer (chat completion, greedy, whole) against the reference's text
    (``text_alone`` or ``text_together``); ``prompts``: a subset of :data:`phases.PROMPTS`."""
    out = {}
    for name, (n, text) in (prompts or phases.PROMPTS).items():
        content = text if not n else [*({"type": "image_url", "image_url": {"url": _png_url(im)}}
                                        for im in phases.images(n)), {"type": "text", "text": text}]
        body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": content}]}
        req = urllib.request.Request(base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                got = json.loads(resp.read())["choices"][0]["message"]["content"]
        except OSError as exc:
            out[name] = f"request failed: {exc}"[:200]
            continue
        if refs is None:
            out[name] = "no reference (phase ref did not run)"
        elif got in (refs[name]["text_alone"], refs[name]["text_together"]):
            out[name] = "equal"
        else:
            out[name] = f"differs: {got[:60]!r} vs {refs[name]['text_alone'][:60]!r}"
        print(f"  {base_url} {name}: {out[name]}", flush=True)
    return out


def _png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------- records
def _label(spec: str) -> str:
    return "vllm serve" if spec == "vllm-serve" else f"fleet {spec.split(':')[1].split(',')[0]} (engine vllm)"


def _ms(x) -> float | str:
    return "–" if x is None else round(float(x), 1)


def _records(args: argparse.Namespace, parity: dict, result: dict) -> None:
    gpu, out = common.gpu_slug(), args.out
    refs = phases.load_refs(out)
    vllm_own = {name: ("same" if r["raw"] == r["alone"] else "differs") for name, r in refs[0].items()} if refs else {}
    rows = [[mode, name, verdict, vllm_own.get(name, "–")]
            for mode, by in parity.items() for name, verdict in by.items()]
    if rows:
        common.write_record(
            out, f"gpu-{gpu}-vllm-fleets", title="vLLM-engine fleets on one GPU against vLLM's offline answers",
            command=phases._command(args), commit_hash=args.commit, conditions=phases._conditions(args, (
                "Each fleet (mmfleet up --mode M, engine vllm, device cuda, the harness's broker and Redis) answers "
                "each prompt once (chat completion, temperature 0), images as PNG data URLs. 'equal': the answer is "
                "the decoded text of vLLM's offline LLM.generate on the fleet encoder's embeddings (each image "
                "alone or a request's images in one batch, as the encode stage may batch them). The last column "
                "compares LLM.generate on the raw images (vLLM's own vision encoder) with that: informational, the "
                "two encoders round differently in bf16.")),
            tables=[{"name": "parity", "columns": ["mode", "prompt", "answer vs LLM.generate",
                                                   "vLLM's own encoder vs the fleet's"], "rows": rows}])
    client = []
    for spec, after in result.get("after", {}).items():
        for c in CLIENT_LEVELS if "client" in after else ():
            r = after["client"].get(f"c={c}", {})
            client.append([_label(spec), c] + (["failed"] * 5 if "error" in r else [
                _ms(r.get("median_ttft_ms")), _ms(r.get("p99_ttft_ms")), _ms(r.get("median_tpot_ms")),
                _ms(r.get("output_throughput")), f"{r.get('completed', 0)} / {r.get('failed', 0)}"]))
    wk, wl = phases.workload(args), window_workload(args)
    n_prompts = CPU_CLIENT_PROMPTS if args.device == "cpu" else CLIENT_PROMPTS
    side, (w, h) = wk["image_side"], wl.resolutions[0]
    if client:
        common.write_record(
            out, f"gpu-{gpu}-vllm-client", title="The vLLM-engine fleet and vllm serve under vLLM's own client",
            command=phases._command(args), commit_hash=args.commit, conditions=phases._conditions(args, (
                "vllm bench serve (vLLM's client, run from loadtest/vllmclient.py), openai-chat backend, random-mm: "
                f"one {side}x{side} image + {wk['input_len']} random text tokens in, {wk['output_len']} out "
                f"(ignore_eos), {n_prompts[1]} prompts at c=1 and {n_prompts[16]} at c=16, after the sliding-window "
                "run. "
                "The e-p-d fleet (encode: transformers vision tower on the GPU; prefill and decode: vLLM engines, KV "
                "over NixlConnector) and vllm serve ran one after the other on the same GPU, each alone.")),
            tables=[{"name": "client", "columns": ["target", "concurrency", "TTFT p50 (ms)", "TTFT p99 (ms)",
                                                   "TPOT p50 (ms)", "output tok/s", "completed / failed"],
                     "rows": client}])
    window = []
    for run in result["runs"]:
        a = run["aggregates"]
        window.append([_label(run["target"]), run["label"], _ms(a["ttft_ms"].get("p50")),
                       _ms(a["ttft_ms"].get("p99")), _ms(a["itl_ms"].get("p50")), _ms(a["output_throughput"]),
                       f"{a['ok']} / {a['requests']}"])
    if window:
        common.write_record(
            out, f"gpu-{gpu}-vllm-window", title="The sliding-window workload: the vLLM-engine fleet and vllm serve",
            command=phases._command(args), commit_hash=args.commit, conditions=phases._conditions(args, (
                "The harness's multiturn workload (loadtest/workloads.py), our streaming client: sessions of 4 turns, "
                f"one new {w}x{h} PNG a turn, each turn resending the conversation with only its last {wl.window} "
                f"images, 16-24 words a turn, {wl.max_tokens[0]} tokens out; {wl.num_requests} requests a level "
                f"({', '.join(f'c={c}' for c in WINDOW_LEVELS)}), turn-major, 2 warm-up requests. The e-p-d fleet and "
                "vllm serve one after the other on the same GPU.")),
            tables=[{"name": "window", "columns": ["target", "load", "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)",
                                                   "output tok/s", "ok / sent"], "rows": window}])

