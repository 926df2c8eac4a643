"""The vLLM engine's serving knobs (``vllm serve``'s flags of the same names), a base of
:class:`shared.settings.Settings`: read with every other setting (``MMFLEET_VLLM_*``, the config
file, the ``mmfleet up`` / ``mmfleet worker`` flags). Only ``engine = "vllm"`` reads them. Values
out of range are refused here; combinations impossible on the worker's device or model are
refused at start (:mod:`shared.engines.vllm_config`).

Docs: docs/guide/vllm.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# the per-request media limits by modality (Settings' media fields): vLLM's limit_mm_per_prompt
MODALITY_LIMITS = {"image": "max_images_per_request", "video": "max_videos_per_request",
                   "audio": "max_audios_per_request"}


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class VllmSettings(msgspec.Struct, kw_only=True, frozen=True):
    """What ``vllm serve`` is told on its command line, for the fleet's vLLM engines."""

    vllm_max_model_len_tokens: Annotated[int, _d(
        "engine vllm: longest prompt + completion, tokens (vllm serve --max-model-len); 0: the model's context; "
        "above the model's: refused at start; the gateway refuses longer requests too")] = 0
    vllm_gpu_memory_utilization: Annotated[float, _d(
        "engine vllm on a GPU: share of the GPU's memory the engine may take, weights and KV cache (vllm serve "
        "--gpu-memory-utilization, in (0, 1]); 0: vLLM's default (0.92 in vLLM 0.32); a CPU engine's KV cache "
        "is a fixed 512 MiB instead")] = 0.0
    vllm_max_num_seqs: Annotated[int, _d(
        "engine vllm: sequences scheduled in one step at most (vllm serve --max-num-seqs); 0: vLLM's engine "
        "default (128 in vLLM 0.32; vllm serve picks up to 1024 by GPU); a worker sends at most "
        "decode_concurrency at once")] = 0
    vllm_max_num_batched_tokens: Annotated[int, _d(
        "engine vllm: prompt + decode tokens in one step at most (vllm serve --max-num-batched-tokens); 0: "
        "vLLM's engine default (2048 in vLLM 0.32, and at least the max model length with chunked prefill off; "
        "vllm serve picks up to 16384 by GPU)")] = 0
    vllm_tensor_parallel_size: Annotated[int, _d(
        "engine vllm: GPUs one engine shards its model over (vllm serve --tensor-parallel-size); needs device "
        "cuda and that many visible GPUs")] = 1
    vllm_quantization: Annotated[str, _d(
        "engine vllm: weight quantization method, as vLLM names it (vllm serve --quantization, e.g. fp8, awq, "
        "compressed-tensors); empty: as the checkpoint says")] = ""
    vllm_kv_cache_dtype: Annotated[str, _d(
        "engine vllm: KV cache element type (vllm serve --kv-cache-dtype: auto, fp8, fp8_e4m3, fp8_e5m2, ...); "
        "auto: the model's dtype; fp8 on CPU needs AVX-512 or AMX")] = "auto"
    vllm_enforce_eager: Annotated[bool | Literal["auto"], _d(
        "engine vllm: true runs the model eagerly (vllm serve --enforce-eager), false captures CUDA graphs "
        "(GPU only); auto: graphs on a GPU, eager on CPU")] = "auto"
    vllm_enable_chunked_prefill: Annotated[bool | Literal["auto"], _d(
        "engine vllm: split long prompts over steps (vllm serve --enable-chunked-prefill / "
        "--no-enable-chunked-prefill); auto: vLLM's choice for the model (on for the served families)")] = "auto"
    vllm_enable_prefix_caching: Annotated[bool, _d(
        "engine vllm: reuse the KV of prompt prefixes seen before (vllm serve --enable-prefix-caching); it "
        "feeds the fleet's KV-aware routing; a decode worker apart from prefill keeps it off whatever this "
        "says")] = True

    def __post_init__(self) -> None:
        for name in ("vllm_max_model_len_tokens", "vllm_max_num_seqs", "vllm_max_num_batched_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (vLLM's default) or more; got {getattr(self, name)}")
        if not 0.0 <= self.vllm_gpu_memory_utilization <= 1.0:
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], or 0 for vLLM's default; "
                             f"got {self.vllm_gpu_memory_utilization}")
        if self.vllm_tensor_parallel_size < 1:
            raise ValueError(f"vllm_tensor_parallel_size must be 1 or more; got {self.vllm_tensor_parallel_size}")
        if not self.vllm_kv_cache_dtype:
            raise ValueError("vllm_kv_cache_dtype must name a dtype (auto: the model's)")
