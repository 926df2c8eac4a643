"""The vLLM GPU check's phases, each run in its own process by :mod:`loadtest.gpu_vllm_check`:
build, preflight, ref (vLLM's offline ``LLM.generate`` answers, written to ``out/ref``) and pd
(the P→D hand-off against them); the fleets phase is :mod:`loadtest.gpu_vllm_fleets`. A phase
prints one line per check and exits non-zero when one fails. Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
from PIL import Image

from loadtest import gpu_vllm_common as common

# name -> (images, text): the parity prompts of ref, pd and the fleets
PROMPTS = {"text": (0, "Tell me a story about the sea."), "one-image": (1, "Describe what you see."),
           "two-images": (2, "Compare the two pictures.")}


def images(n: int) -> list[Image.Image]:
    """A 448² noise image (256 LM tokens) and a 448x336 gradient (192), deterministic."""
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (448, 448, 3), dtype=np.uint8))
    x = np.linspace(0, 255, 448, dtype=np.uint8)
    grad = Image.fromarray(np.stack([np.tile(x, (336, 1)), np.tile(x[::-1], (336, 1)),
                                     np.full((336, 448), 90, np.uint8)], axis=-1))
    return [noise, grad][:n]


def messages(n_images: int, text: str) -> list[dict]:
    if not n_images:
        return [{"role": "user", "content": text}]
    parts = [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def model_dir(args: argparse.Namespace, *, build: bool = False, cpu_fallback: bool = False) -> Path | None:
    """``--model-dir``, else the 2B-shaped build (made here with ``build``), else (``cpu_fallback``)
    the tiny model, which the preflight's CPU rehearsal takes."""
    from shared.models import build_cache
    from shared.models.qwen2_vl_tiny import QWEN2_VL_2B, TINY, ensure_tiny_qwen2_vl, recipe_hash

    if args.model_dir:
        return args.model_dir
    cpu_fallback = cpu_fallback or args.device == "cpu"
    if build and not cpu_fallback:
        return ensure_tiny_qwen2_vl(args.cache_dir, size=QWEN2_VL_2B)
    final = args.cache_dir / f"qwen2-vl-{QWEN2_VL_2B.name}-{recipe_hash(0, QWEN2_VL_2B)}"
    if (final / build_cache.MARKER).is_file():
        return final
    return ensure_tiny_qwen2_vl(args.cache_dir, size=TINY) if cpu_fallback else None


def knobs(args: argparse.Namespace):
    from shared.settings_vllm import VllmSettings

    return VllmSettings(vllm_gpu_memory_utilization=args.gpu_memory_utilization if args.device == "cuda" else 0.0,
                        vllm_enforce_eager=not args.cuda_graphs, vllm_max_model_len_tokens=args.max_model_len)


def dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.device == "cuda" else "float32"


def fit(args: argparse.Namespace, md: Path) -> argparse.Namespace:
    """``args`` with max_model_len at most the model's context (the tiny model's 4096 on CPU)."""
    context = int(json.loads((md / "config.json").read_text())["text_config"]["max_position_embeddings"])
    return argparse.Namespace(**{**vars(args), "max_model_len": min(args.max_model_len, context)})


def engine(md: Path, args: argparse.Namespace, **kw):
    """A fleet vLLM engine on this GPU, as a prefill / decode / generate worker builds it."""
    from shared.engines.vllm_engine import VllmEngine

    return VllmEngine(md, serving=knobs(args), device=args.device, dtype=dtype(args), **kw)


def greedy(args: argparse.Namespace):
    from shared import protocol

    return protocol.Sampling(max_tokens=args.max_tokens, temperature=0.0)


def run(name: str, args: argparse.Namespace, *, fleets) -> int:
    """``fleets``: phase fleets' function (:mod:`loadtest.gpu_vllm_fleets`, which imports this module)."""
    t0 = time.monotonic()
    if name != "build" and (md := model_dir(args)) is not None:
        args = fit(args, md)
    if name == "fleets":
        ok = fleets(args)
    else:
        ok = {"build": build, "preflight": preflight, "ref": ref, "pd": pd}[name](args)
    print(f"{name}: {'passed' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0 if ok else 1


# ---------------------------------------------------------------- build
def build(args: argparse.Namespace) -> bool:
    md = model_dir(args, build=True)
    size = sum(p.stat().st_size for p in md.glob("*.safetensors"))
    print(f"model: {md} ({size / 1e9:.2f} GB of weights)", flush=True)
    return True


# ---------------------------------------------------------------- preflight
def preflight(args: argparse.Namespace) -> bool:
    """What the other phases lean on, in seconds and without a model on the GPU: imports, the
    parsers of ``vllm serve`` and ``vllm bench serve``, the fleet's engine arguments and KV
    configs as vLLM's own classes, the fleet settings, redis-server and the broker binary."""
    import torch

    md = model_dir(args, cpu_fallback=True)
    args = fit(args, md)  # the tiny model of a CPU rehearsal: 4096 positions
    # vLLM's platform: the CUDA build finds none without a GPU (a CPU rehearsal of the GPU run)
    on_gpu = args.device == "cpu" or torch.cuda.is_available()
    probe = Probes()
    for mod in ("vllm", "vllm.v1.engine.async_llm", "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server",
                "vllm.benchmarks.serve", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
                "shared.engines.vllm_engine", "shared.engines.vllm_connector", "shared.engines.vllm_structured",
                "shared.transfer", "services.cli", "nixl._api"):
        probe(f"import {mod}", lambda m=mod: __import__(m) and None)
    probe("vllm serve: its parser and app take our flags", lambda: _serve_app(md, args, on_gpu))
    probe("vllm bench serve: its parser takes ours, random-mm samples", lambda: _bench_samples(md, args))
    for role, buf in ((None, "auto"), ("kv_producer", "cuda" if args.device == "cuda" else "cpu"),
                      ("kv_consumer", "cpu")):
        probe(f"fleet engine args as vLLM's ({role or 'generate'}, KV buffer {buf})",
              lambda r=role, b=buf: _engine_args(md, args, r, b, on_gpu))
    probe("greedy sampling params, a producer's", lambda: _sampling(md, args))
    probe("fleet settings of the check's fleets", lambda: _fleet_settings(md, args))
    probe("redis-server on PATH", lambda: subprocess.run([shutil.which("redis-server") or "redis-server",
                                                          "--version"], capture_output=True, text=True,
                                                         check=True).stdout.strip()[:60])
    probe("the embedded broker's binary", _broker_binary)
    return probe.finish(args.out / "preflight.json")


class NeedsGpu(Exception):
    """A probe that needs vLLM's platform: the CUDA build finds none without a GPU."""


class Probes:
    """A preflight's probes: each one line (ok / skip / FAIL), none stopping the others."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str | None]] = []

    def __call__(self, what: str, fn) -> None:
        try:
            self.results.append((what, None if (detail := fn()) is None else str(detail)))
            print(f"  ok   {what}" + (f": {self.results[-1][1]}" if self.results[-1][1] else ""), flush=True)
        except NeedsGpu as exc:
            self.results.append((what, f"skipped: {exc}"))
            print(f"  skip {what}: {exc}", flush=True)
        except Exception as exc:  # noqa: BLE001 - every probe reports; the phase fails at the end
            self.results.append((what, f"FAILED {type(exc).__name__}: {exc}"[:600]))
            print(f"  FAIL {what}: {self.results[-1][1]}", flush=True)

    def finish(self, path: Path) -> bool:
        """Write the results to ``path``; True when none failed."""
        path.write_text(json.dumps(self.results, indent=1))
        return all(detail is None or not detail.startswith("FAILED") for _, detail in self.results)


def _serve_app(md: Path, args: argparse.Namespace, on_gpu: bool) -> str:
    if not on_gpu:  # its parser's defaults build vLLM's DeviceConfig, which needs the platform
        raise NeedsGpu("vllm serve's parser needs the CUDA platform")
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", str(md), "--served-model-name", "mmfleet-demo", "--seed", "0", *common.serve_args(args),
         "--limit-mm-per-prompt", json.dumps({"image": 8, "video": 0}), "--disable-log-stats"])
    validate_parsed_serve_args(ns)
    app = build_app(ns, ("generate",))
    return f"{len(app.routes)} routes"


def _bench_samples(md: Path, args: argparse.Namespace) -> str:
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from loadtest import vllmclient

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(vllmclient.client_argv("http://127.0.0.1:1", model="mmfleet-demo", tokenizer=md,
                                                  concurrency=16, num_prompts=4, result_dir=Path("/tmp"),
                                                  result_file="x.json", **workload(args)))
    samples = get_samples(ns, AutoTokenizer.from_pretrained(str(md)))
    return f"{len(samples)} samples, {sum(1 for s in samples if s.multi_modal_data)} with an image"


def workload(args: argparse.Namespace) -> dict:
    """vLLM's client in the fleets phase: one 448² image, 64 tokens in, 64 out (CPU: 224², 16, 8)."""
    if args.device == "cpu":
        return {"image_side": 224, "input_len": 16, "output_len": 8}
    return {"image_side": 448, "input_len": 64, "output_len": 64}


def _engine_args(md: Path, args: argparse.Namespace, role: str | None, buf: str, on_gpu: bool) -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from shared.engines import vllm_kv_events

    kw = {"kv_role": role, "kv_buffer_device": buf} if role else {}
    engine_args = engine(md, args, **kw).engine_args()
    if role == "kv_producer":
        engine_args["kv_events_config"] = vllm_kv_events.events_config(vllm_kv_events.ipc_endpoint())
    parsed = AsyncEngineArgs(**engine_args)
    if not on_gpu:
        raise NeedsGpu(f"{len(engine_args)} arguments taken by AsyncEngineArgs; its config is built on a GPU only")
    config = parsed.create_engine_config()
    return f"max_model_len {config.model_config.max_model_len}, dtype {config.model_config.dtype}"


def _sampling(md: Path, args: argparse.Namespace) -> str:
    from shared.engines import vllm_sampling

    eng = engine(md, args, kv_role="kv_producer")
    params = vllm_sampling.sampling_params(greedy(args), eng.eos_token_ids, {"do_remote_decode": True})
    return f"max_tokens {params.max_tokens}, stop {params.stop_token_ids}"


def _fleet_settings(md: Path, args: argparse.Namespace) -> str:
    from loadtest.targets import fleet_settings
    from shared import settings as settings_mod
    from shared.engines import vllm_config

    for mode in ("epd", "e-p-d"):
        spec = f"fleet:{mode}," + ",".join(f"{k}={v}" for k, v in common.engine_settings(args).items())
        s = settings_mod.from_env(fleet_settings(spec))
        problems = vllm_config.refusals(s, md, args.device, dtype(args), gpu_count=1)
        if problems:
            raise ValueError(f"{mode}: " + "; ".join(problems))
    return "epd and e-p-d accepted"


def _broker_binary() -> str:
    from services import embedded_broker

    argv, _ = embedded_broker.command("tcp://127.0.0.1:1")
    if not Path(argv[0]).is_file():
        raise FileNotFoundError(argv[0])
    return argv[0]


# ---------------------------------------------------------------- ref: vLLM's offline answers
def ref(args: argparse.Namespace) -> bool:
    """The encoder's embeddings (each image alone, and a request's images in one batch, as the
    encode stage may batch them) and vLLM's offline greedy tokens for them, and vLLM's own
    tokens from the raw images (its vision encoder): ``out/ref/refs.json`` + ``embeds.pt``."""
    import torch
    from vllm import LLM
    from vllm.sampling_params import RequestOutputKind

    from shared.engines import vllm_sampling
    from shared.engines.base import MediaEmbeds
    from shared.engines.qwen2_vl import Qwen2VLCompute

    md = model_dir(args)
    compute = Qwen2VLCompute(md, device=args.device, dtype=dtype(args))  # as the encode stage runs it
    embeds, prompts = {}, {}
    for name, (n, text) in PROMPTS.items():
        px = [compute.preprocess_image(im) for im in images(n)]
        alone = [compute.encode_media([p])[0].float().cpu() for p in px]
        together = [e.float().cpu() for e in compute.encode_media(px)] if n > 1 else alone
        embeds[name] = {"alone": alone, "together": together, "grids": [tuple(p.grid_thw) for p in px]}
        prompts[name] = compute.render_prompt_ids(messages(n, text))
    chat = {name: compute.processor.apply_chat_template(messages(n, text), tokenize=False, add_generation_prompt=True)
            for name, (n, text) in PROMPTS.items()}
    tokenizer, eos = compute.tokenizer, compute.eos_token_ids
    del compute
    if args.device == "cuda":
        torch.cuda.empty_cache()

    eng = engine(md, args)
    llm = LLM(**eng.engine_args())
    params = vllm_sampling.sampling_params(greedy(args), eos)
    params.output_kind = RequestOutputKind.FINAL_ONLY

    def tokens(prompt: dict) -> list[int]:  # one request at a time, as the parity requests come
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    refs: dict = {}
    for name, (n, _text) in PROMPTS.items():
        e = embeds[name]
        got = {k: tokens(eng.prompts.build(prompts[name], [MediaEmbeds(x, g) for x, g in zip(e[k], e["grids"])]))
               for k in ("alone", "together")}
        got["raw"] = tokens({"prompt": chat[name], **({"multi_modal_data": {"image": images(n)}} if n else {})})
        refs[name] = {"prompt_ids": prompts[name], **got,
                      **{f"text_{k}": tokenizer.decode(v, skip_special_tokens=True) for k, v in got.items()}}
        print(f"  {name}: {len(got['alone'])} tokens {got['alone'][:8]}...; batched encode "
              f"{'same' if got['together'] == got['alone'] else 'DIFFERS'}; vLLM's own encoder "
              f"{'same' if got['raw'] == got['alone'] else 'differs'}", flush=True)
    folder = args.out / "ref"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(embeds, folder / "embeds.pt")
    (folder / "refs.json").write_text(json.dumps(refs, indent=1))
    return all(len(set(r["alone"])) > 1 for r in refs.values())  # a degenerate model proves nothing


def load_refs(out: Path) -> tuple[dict, dict] | None:
    import torch

    folder = out / "ref"
    if not (folder / "refs.json").is_file():
        return None
    return json.loads((folder / "refs.json").read_text()), torch.load(folder / "embeds.pt")


# ---------------------------------------------------------------- pd: the P->D hand-off
def pd(args: argparse.Namespace) -> bool:
    loaded = load_refs(args.out)
    if loaded is None:
        print("  no references (phase ref did not run)", flush=True)
        return False
    rows = asyncio.run(_pd_rows(args, *loaded))
    ok = not any(r[2].startswith("differs") for r in rows)
    common.write_record(args.out, f"gpu-{common.gpu_slug()}-vllm-pd", title="vLLM prefill and decode apart on one GPU",
                       command=_command(args), commit_hash=args.commit, conditions=_conditions(args, (
                           "A kv_producer engine prefills (max_tokens 1, do_remote_decode), a kv_consumer engine "
                           "reads its KV with vLLM's NixlConnector and decodes; both are the fleet's VllmEngine. "
                           "Images reach the producer as the fleet encoder's embeddings, the consumer sees zero "
                           "placeholders. Reference: vLLM's offline LLM.generate on the same prompt ids and "
                           "embeddings, one request at a time.")),
                       tables=[{"name": "handoff", "rows": rows, "columns": [
                           "KV buffer", "prompt", "greedy tokens equal LLM.generate", "engines up (s)"]}])
    return ok


async def _pd_rows(args: argparse.Namespace, refs: dict, embeds: dict) -> list[list]:
    from shared import protocol
    from shared.engines import vllm_pd
    from shared.engines.base import MediaEmbeds

    md = model_dir(args)
    rows = []
    for buf in ("cuda", "cpu") if args.device == "cuda" else ("cpu",):
        producer = engine(md, args, kv_role=vllm_pd.PRODUCER, kv_buffer_device=buf, kv_lease_s=20)
        consumer = engine(md, args, kv_role=vllm_pd.CONSUMER, kv_buffer_device=buf)
        t0 = time.monotonic()
        try:
            # one after the other: an engine's build sets this process's environment for its core
            # (shared/engines/vllm_process.py), so two at once would swap side-channel ports
            await producer.start()
            await consumer.start()
            up_s = round(time.monotonic() - t0, 1)
            for name in PROMPTS:
                e = embeds[name]
                media = [MediaEmbeds(x, g) for x, g in zip(e["alone"], e["grids"])]
                ids = refs[name]["prompt_ids"]
                out = await producer.prefill(f"pd-{buf}-{name}", ids, media, greedy(args))
                wire = protocol.decoder_for(protocol.EngineKv).decode(protocol.encode(out.engine_kv))
                rest = [t async for t in consumer.decode_remote(f"pd-{buf}-{name}", ids, wire, out.first_token,
                                                                greedy(args))]
                rows.append([buf, name, _verdict([out.first_token, *rest], refs[name]["alone"]), up_s])
                print(f"  KV buffer {buf}, {name}: {rows[-1][2]}", flush=True)
        finally:
            await asyncio.gather(consumer.stop(), producer.stop(), return_exceptions=True)
    return rows


def _verdict(got: list[int], want: list[int]) -> str:
    if got == want:
        return f"{len(want)} of {len(want)}"
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"differs at token {k} ({len(got)} vs {len(want)} tokens)"


def _command(args: argparse.Namespace) -> str:
    return "make gpu-vllm-check" + (" GPU_VLLM_CHECK_ARGS=--cuda-graphs" if args.cuda_graphs else "")


def _conditions(args: argparse.Namespace, what: str) -> str:
    model = ("random weights with Qwen2-VL-2B's shapes (shared/models/qwen2_vl_tiny.py QWEN2_VL_2B), bf16"
             if args.device == "cuda" else "the tiny Qwen2-VL, float32 on CPU (a rehearsal, not a figure)")
    if args.model_dir:
        model = f"{args.model_dir}, {dtype(args)}"
    return (f"{what} Model: {model}; every vLLM engine {'with CUDA graphs' if args.cuda_graphs else 'eager'}, "
            f"gpu_memory_utilization {args.gpu_memory_utilization}, max_model_len {args.max_model_len}; greedy, "
            f"max_tokens {args.max_tokens}.")
