"""The fleet's settings as ``sglang.Engine``'s keyword arguments (its ``ServerArgs``), and what a
worker refuses before it builds one: :func:`startup_refusal` (SGLang not importable, no CUDA GPU
in sight), :func:`refusals` (settings that clash with the device or the model, each reason
naming the settings). Imports no SGLang; :func:`check` is what the worker's preflight and
``mmfleet up`` call.

Design: docs/design/sglang-engine.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from shared.settings_sglang import SglangSettings

SGLANG_PIN = "sglang==0.5.12"  # the release whose torch pin (2.11.0) the GPU image has


def server_args(model_dir: str | Path, knobs: SglangSettings, *, dtype: str, seed: int, context_length: int,
                gpu_id: int = 0) -> dict:
    """``sglang.Engine(**kwargs)`` for one engine (names as sglang/srt/server_args.py's ServerArgs).
    A knob left at 0 is not passed: SGLang applies its own default."""
    args: dict = dict(
        model_path=str(model_dir),
        tokenizer_path=str(model_dir),
        dtype=dtype,
        random_seed=seed,
        context_length=context_length,
        device="cuda",
        base_gpu_id=gpu_id,
        tp_size=knobs.sglang_tp_size,
        enable_multimodal=True,
        trust_remote_code=False,
        disable_radix_cache=knobs.sglang_disable_radix_cache,
        disable_cuda_graph=knobs.sglang_disable_cuda_graph,
        log_level="error",
    )
    if knobs.sglang_mem_fraction_static > 0:
        args["mem_fraction_static"] = knobs.sglang_mem_fraction_static
    if knobs.sglang_max_running_requests > 0:
        args["max_running_requests"] = knobs.sglang_max_running_requests
    if knobs.sglang_chunked_prefill_size_tokens:
        args["chunked_prefill_size"] = knobs.sglang_chunked_prefill_size_tokens
    return args


def startup_refusal(device: str, environ: dict[str, str] | None = None, *, importable: bool | None = None,
                    gpu_count: int | None = None) -> str | None:
    """Why no SGLang engine can start in this process (None: nothing known against it).
    ``importable`` and ``gpu_count`` are asked of Python and torch when None."""
    env = os.environ if environ is None else environ
    if importable is None:
        importable = importlib.util.find_spec("sglang") is not None
    if not importable:
        return (f"sglang is not installed: pip install {SGLANG_PIN} on a CUDA host (SGLang has no CPU build; "
                "a GPU host without an index: python -m loadtest.gpu_wheels prepare, docs/deploy/gpus.md), or "
                "set engine transformers or vllm")
    if device.split(":")[0] != "cuda":
        return (f"engine sglang runs on a CUDA GPU only, but device is {device!r} (setting device: set it to cuda "
                "or cuda:N)")
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return (f"engine sglang needs a CUDA GPU, but CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} "
                "hides every one")
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    if gpu_count < 1:
        return "engine sglang needs a CUDA GPU, and torch sees none here (setting device)"
    return None


def gpu_index(device: str) -> int:
    """``cuda:N`` → N (SGLang's ``base_gpu_id``); ``cuda`` → 0."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def refusals(knobs: SglangSettings, model_dir: str | Path, device: str, *, gpu_count: int) -> list[str]:
    """Why an SGLang engine on ``device`` cannot serve ``model_dir`` with these settings."""
    out = []
    tp = knobs.sglang_tp_size
    if tp > 1 and ":" in device:
        out.append(f"sglang_tp_size {tp} needs {tp} GPUs, but device {device!r} gives the engine one; device "
                   "cuda shards over the GPUs CUDA_VISIBLE_DEVICES shows")
    elif tp > 1 and gpu_count < tp:
        out.append(f"sglang_tp_size {tp} needs {tp} GPUs, but device {device!r} sees {gpu_count}")
    if ":" in device and gpu_index(device) >= gpu_count:
        out.append(f"device {device!r} names a GPU this process does not see ({gpu_count} visible)")
    context = model_context(model_dir)
    if knobs.sglang_context_length_tokens > context:
        out.append(f"sglang_context_length_tokens {knobs.sglang_context_length_tokens} is above the context of the "
                   f"model (setting model: {model_dir}, {context} tokens)")
    chunk = knobs.sglang_chunked_prefill_size_tokens
    if chunk > 0 and knobs.sglang_max_running_requests > chunk:
        out.append(f"sglang_chunked_prefill_size_tokens {chunk} is below sglang_max_running_requests "
                   f"{knobs.sglang_max_running_requests} (each running request takes one token of a step at least)")
    return out


def model_context(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["max_position_embeddings"])


def check(settings, model_dir: str | Path) -> None:
    """``ValueError`` naming every reason an SGLang engine cannot start as the settings say (the
    worker's preflight and ``mmfleet up`` call it before anything starts)."""
    device = settings.device.strip().lower()
    why = startup_refusal(device)
    if why:
        raise ValueError(why)
    import torch

    problems = refusals(settings, model_dir, device, gpu_count=torch.cuda.device_count())
    if problems:
        raise ValueError("; ".join(problems))
