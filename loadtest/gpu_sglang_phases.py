"""The SGLang GPU check's phases, each run in its own process by :mod:`loadtest.gpu_sglang_check`:
build (the vLLM check's), preflight and offline (SGLang's ``Engine.generate`` answers, written to
``out/ref/refs.json``); fleets and serve are :mod:`loadtest.gpu_sglang_serve`. A phase prints one
line per check and exits non-zero when one fails. Docs: docs/deploy/gpus.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from loadtest import gpu_vllm_common as common
from loadtest import gpu_vllm_phases as vphases

# the vLLM check's prompts SGLang can take: its adapter maps one image per request at most
PROMPTS = {name: vphases.PROMPTS[name] for name in ("text", "one-image")}


def engine_settings(args: argparse.Namespace) -> dict[str, str]:
    """The fleet's settings (as ``fleet:<mode>,name=value`` takes them) every SGLang fleet runs with."""
    return {"engine": "sglang", "device": "cuda", "sglang_mem_fraction_static": str(args.mem_fraction_static),
            "sglang_context_length_tokens": str(args.max_model_len),
            "sglang_disable_cuda_graph": "false" if args.cuda_graphs else "true"}


def fleet_spec(mode: str, args: argparse.Namespace) -> str:
    return f"fleet:{mode}," + ",".join(f"{k}={v}" for k, v in engine_settings(args).items())


def knobs(args: argparse.Namespace):
    from shared.settings_sglang import SglangSettings

    return SglangSettings(sglang_mem_fraction_static=args.mem_fraction_static,
                          sglang_context_length_tokens=args.max_model_len,
                          sglang_disable_cuda_graph=not args.cuda_graphs)


def engine(md: Path, args: argparse.Namespace, **kw):
    """A fleet SGLang engine, as a generate worker builds it (nothing starts until ``start``)."""
    from shared.engines.sglang_engine import SglangEngine

    return SglangEngine(md, serving=knobs(args), device="cuda", dtype="bfloat16", **kw)


def server_flags(kwargs: dict) -> list[str]:
    """``sglang.Engine``'s keyword arguments as ``launch_server``'s flags (ServerArgs.add_cli_args
    names each field ``--field-name``; a True bool is a bare flag, a False one is left out)."""
    out = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    return out


# ---------------------------------------------------------------- preflight
BENCH_FLAGS = ("--backend", "--base-url", "--dataset-name", "--model", "--tokenizer", "--num-prompts",
               "--random-input-len", "--random-output-len", "--image-count", "--image-resolution", "--image-format",
               "--max-concurrency", "--output-file", "--seed", "--disable-tqdm", "--warmup-requests")


def preflight(args: argparse.Namespace) -> bool:
    """What the other phases lean on, without a model on the GPU: imports, the fleet engine's
    ``Engine`` arguments as SGLang's ``ServerArgs`` (the same fields through ``launch_server``'s
    parser), ``bench_serving``'s flags and backend, the fleets' settings, redis-server, the broker."""
    md = vphases.model_dir(args)
    probe = vphases.Probes()
    for mod in ("sglang", "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server",
                "sglang.srt.server_args", "sglang.srt.models.qwen2_vl", "sglang.srt.multimodal.processors.qwen_vl",
                "sglang.srt.managers.scheduler", "sgl_kernel", "flashinfer", "xgrammar", "transformers",
                "shared.engines.sglang_engine", "shared.transfer", "services.cli", "nixl._api"):
        probe(f"import {mod}", lambda m=mod: __import__(m) and None)
    probe("our Engine arguments as ServerArgs, and the same through launch_server's parser",
          lambda: _server_args(md, args))
    probe("bench_serving takes our flags and the sglang-oai-chat backend", _bench_help)
    probe("fleet settings of the check's fleets", lambda: _fleet_settings(md, args))
    probe("redis-server on PATH", lambda: subprocess.run(["redis-server", "--version"], capture_output=True,
                                                         text=True, check=True).stdout.strip()[:60])
    probe("the embedded broker's binary", vphases._broker_binary)
    return probe.finish(args.out / "preflight.json")


def _server_args(md: Path, args: argparse.Namespace) -> str:
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    kwargs = engine(md, args).server_args()
    unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(ServerArgs)})
    if unknown:
        raise ValueError(f"not ServerArgs fields: {unknown}")
    ours = ServerArgs(**kwargs)
    cli = prepare_server_args(server_flags(kwargs))
    differ = {k: (getattr(ours, k), getattr(cli, k)) for k in kwargs if getattr(ours, k) != getattr(cli, k)}
    if differ:
        raise ValueError(f"launch_server's parser gives other values: {differ}")
    return (f"{len(kwargs)} arguments; context {ours.context_length}, mem_fraction_static {ours.mem_fraction_static}, "
            f"attention {ours.attention_backend}, sampling {ours.sampling_backend}")


def _bench_help() -> str:
    out = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--help"], capture_output=True, text=True,
                         timeout=120)
    missing = [f for f in BENCH_FLAGS if f not in out.stdout]
    if out.returncode or missing or "sglang-oai-chat" not in out.stdout:
        raise ValueError(f"exit {out.returncode}; flags not offered {missing}; {out.stderr[-300:]}")
    return f"{len(BENCH_FLAGS)} flags"


def _fleet_settings(md: Path, args: argparse.Namespace) -> str:
    from loadtest.targets import fleet_settings
    from shared import settings as settings_mod
    from shared.engines import sglang_config

    for mode in ("epd", "e-pd"):
        sglang_config.check(settings_mod.from_env(fleet_settings(fleet_spec(mode, args))), md)
    return "epd and e-pd accepted"


# ---------------------------------------------------------------- offline: SGLang's own answers
def offline(args: argparse.Namespace) -> bool:
    """``sglang.Engine.generate``, greedy, one request at a time, with the fleet engine's arguments:
    the text prompt from its ids; the one-image prompt from SGLang's own processor (raw image) and
    from the fleet encoder's embeddings through our mapping (:mod:`shared.engines.sglang_inputs`)."""
    import sglang
    import torch

    from shared.engines import sglang_sampling
    from shared.engines.base import MediaEmbeds
    from shared.engines.qwen2_vl import Qwen2VLCompute

    md = vphases.model_dir(args)
    compute = Qwen2VLCompute(md, device="cuda", dtype="bfloat16")  # as the encode stage runs it
    ids = {name: compute.render_prompt_ids(vphases.messages(n, text)) for name, (n, text) in PROMPTS.items()}
    px = compute.preprocess_image(vphases.images(1)[0])
    media = [MediaEmbeds(compute.encode_media([px])[0].float().cpu(), tuple(px.grid_thw))]
    chat = compute.processor.apply_chat_template(vphases.messages(1, PROMPTS["one-image"][1]), tokenize=False,
                                                 add_generation_prompt=True)
    tokenizer = compute.tokenizer
    del compute
    torch.cuda.empty_cache()

    fleet_engine = engine(md, args, modalities=frozenset({"image"}))  # the mapping alone: the fleet serves text
    params = sglang_sampling.sampling_params(vphases.greedy(args))
    t0 = time.monotonic()
    llm = sglang.Engine(**fleet_engine.server_args())
    up_s = round(time.monotonic() - t0, 1)
    try:
        def tokens(**request) -> list[int]:
            return list(llm.generate(sampling_params=params, **request)["output_ids"])

        got = {"text": tokens(input_ids=ids["text"]),
               "raw": tokens(prompt=chat, image_data=[vphases.images(1)[0]]),
               "embeds": tokens(**fleet_engine.prompts.build(ids["one-image"], media))}
    finally:
        llm.shutdown()
    text = {k: tokenizer.decode(v, skip_special_tokens=True) for k, v in got.items()}
    refs = {"text": {"prompt_ids": ids["text"], "alone": got["text"], "text_alone": text["text"],
                     "text_together": text["text"]},
            "one-image": {"prompt_ids": ids["one-image"], "alone": got["raw"], "embeds": got["embeds"],
                          "text_alone": text["raw"], "text_together": text["raw"]}}
    folder = args.out / "ref"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "refs.json").write_text(json.dumps(refs, indent=1))
    same = "same" if got["embeds"] == got["raw"] else "differs"
    print(f"  engine up in {up_s} s; text {got['text'][:8]}...; one image (SGLang's processor) {got['raw'][:8]}...; "
          f"from our embeddings {same}", flush=True)
    common.write_record(
        args.out, f"gpu-{common.gpu_slug()}-sglang-offline", title="SGLang's offline answers on one GPU",
        command=command(args), commit_hash=args.commit, conditions=conditions(args, (
            "sglang.Engine with the fleet engine's arguments (shared/engines/sglang_config.py), generate() one "
            "request at a time. The one-image prompt twice: SGLang's own processor and vision tower on the raw "
            "image, and the fleet encoder's embeddings mapped as the adapter maps them (processor_output items); "
            "the fleet serves that mapping only once the two agree (docs/design/sglang-engine.md).")),
        tables=[{"name": "offline", "columns": ["prompt", "input", "greedy tokens", "vs SGLang's processor",
                                                "engine up (s)"],
                 "rows": [["text", "input_ids", len(got["text"]), "–", up_s],
                          ["one-image", "raw image", len(got["raw"]), "–", up_s],
                          ["one-image", "our embeddings", len(got["embeds"]), same, up_s]]}])
    return len(set(got["text"])) > 1  # a degenerate model proves nothing


def command(args: argparse.Namespace) -> str:
    return "make gpu-sglang-check" + (" GPU_SGLANG_CHECK_ARGS=--cuda-graphs" if args.cuda_graphs else "")


def conditions(args: argparse.Namespace, what: str) -> str:
    model = (f"{args.model_dir}, bf16" if args.model_dir else
             "random weights with Qwen2-VL-2B's shapes (shared/models/qwen2_vl_tiny.py QWEN2_VL_2B), bf16")
    return (f"{what} Model: {model}; every SGLang engine {'with' if args.cuda_graphs else 'without'} CUDA graphs, "
            f"mem_fraction_static {args.mem_fraction_static}, context_length {args.max_model_len}; greedy, "
            f"max_tokens {args.max_tokens}.")
