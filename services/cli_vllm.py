"""``vllm serve``'s serving flags on ``mmfleet up`` and ``mmfleet worker``, spelled as vLLM spells
them; each sets a ``vllm_*`` setting (``--limit-mm-per-prompt`` the per-modality media settings),
with the precedence of every flag: defaults < config file < environment < flags.

Docs: docs/guide/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import re

from shared.settings_vllm import MODALITY_LIMITS

# flag destinations that are setting names as they are
SETTINGS = ("vllm_max_model_len_tokens", "vllm_gpu_memory_utilization", "vllm_max_num_seqs",
            "vllm_max_num_batched_tokens", "vllm_tensor_parallel_size", "vllm_quantization", "vllm_kv_cache_dtype",
            "vllm_enforce_eager", "vllm_enable_chunked_prefill", "vllm_enable_prefix_caching")
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}  # vLLM's human-readable counts


def add_flags(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("vLLM engine (--engine vllm; as vllm serve; each sets a MMFLEET_VLLM_* setting)")
    g.add_argument("--max-model-len", type=token_count, dest="vllm_max_model_len_tokens", metavar="TOKENS",
                   help="longest prompt + completion (32768, 32k, 32K); default: the model's context")
    g.add_argument("--gpu-memory-utilization", type=float, dest="vllm_gpu_memory_utilization", metavar="FRACTION",
                   help="share of the GPU's memory the engine takes; default: vLLM's")
    g.add_argument("--max-num-seqs", type=int, dest="vllm_max_num_seqs", metavar="N",
                   help="sequences per step at most; default: vLLM's")
    g.add_argument("--max-num-batched-tokens", type=token_count, dest="vllm_max_num_batched_tokens",
                   metavar="TOKENS", help="tokens per step at most; default: vLLM's")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, dest="vllm_tensor_parallel_size", metavar="N",
                   help="GPUs one engine shards its model over (device cuda); default 1")
    g.add_argument("--quantization", "-q", dest="vllm_quantization", metavar="METHOD",
                   help="weight quantization method, as vLLM names it; default: the checkpoint's")
    g.add_argument("--kv-cache-dtype", dest="vllm_kv_cache_dtype", metavar="DTYPE",
                   help="KV cache element type: auto (the model's), fp8, ...")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, dest="vllm_enforce_eager",
                   help="run the model eagerly (--no-enforce-eager: CUDA graphs); default: graphs on a GPU, "
                        "eager on CPU")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   dest="vllm_enable_chunked_prefill", help="split long prompts over steps; default: vLLM's choice")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   dest="vllm_enable_prefix_caching",
                   help="reuse the KV of prompt prefixes; default: on (always off in a decode worker apart)")
    g.add_argument("--limit-mm-per-prompt", type=mm_limits, metavar="JSON",
                   help='media items per request by modality, e.g. \'{"image":4}\' (sets max_images_per_request, '
                        "max_videos_per_request, max_audios_per_request)")


def overrides(args: argparse.Namespace) -> dict:
    """The settings these flags set (None: not given)."""
    out = {name: getattr(args, name, None) for name in SETTINGS}
    out.update(getattr(args, "limit_mm_per_prompt", None) or {})
    return out


def token_count(text: str) -> int:
    """``32768``, ``32k`` (32,000) or ``32K`` (32,768), as ``vllm serve`` reads them."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", text.strip())
    if not m or ("." in m[1] and m[2] in ("", "K", "M")):
        raise argparse.ArgumentTypeError(f"expected a token count such as 32768, 32k or 32K, got {text!r}")
    return int(float(m[1]) * _MULTIPLIERS[m[2]])


def mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt`` (vLLM's JSON: a count, or ``{"count": n, ...}``, per modality) ->
    the media settings it sets. 0 is refused: vLLM reads it as "none of these", the settings as
    "no limit of its own"."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError('expected a JSON object such as {"image": 4}')
    out = {}
    for modality, value in given.items():
        if modality not in MODALITY_LIMITS:
            raise argparse.ArgumentTypeError(f"unknown modality {modality!r}; choose from "
                                             f"{', '.join(MODALITY_LIMITS)}")
        count = value.get("count") if isinstance(value, dict) else value
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise argparse.ArgumentTypeError(f"{modality}: expected a count of 1 or more, got {value!r} (mmfleet "
                                             "has no per-request switch to refuse a modality)")
        out[MODALITY_LIMITS[modality]] = count
    return out
