"""The SGLang engine's serving knobs (``python -m sglang.launch_server``'s flags of the same names),
in the chain of bases of :class:`shared.settings.Settings` (msgspec takes fields from one base
only, so this one extends :class:`shared.settings_vllm.VllmSettings`). Only ``engine = "sglang"``
reads them; a knob left at 0 is not passed, so SGLang applies its own default. Values out of
range are refused here; combinations the device or model cannot take are refused at start
(:mod:`shared.engines.sglang_config`).

Docs: docs/design/sglang-engine.md.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.settings_vllm import VllmSettings


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class SglangSettings(VllmSettings, kw_only=True, frozen=True):
    """What ``sglang.launch_server`` is told on its command line, for the fleet's SGLang engines."""

    sglang_mem_fraction_static: Annotated[float, _d(
        "engine sglang: share of the GPU's memory for weights and KV cache (launch_server --mem-fraction-static, "
        "in (0, 1)); 0: SGLang's choice from the GPU's size")] = 0.0
    sglang_max_running_requests: Annotated[int, _d(
        "engine sglang: requests decoded together at most (launch_server --max-running-requests); 0: SGLang's "
        "choice from the KV cache's size")] = 0
    sglang_tp_size: Annotated[int, _d(
        "engine sglang: GPUs one engine shards its model over (launch_server --tp-size); needs device cuda and "
        "that many visible GPUs")] = 1
    sglang_context_length_tokens: Annotated[int, _d(
        "engine sglang: longest prompt + completion, tokens (launch_server --context-length); 0: the model's "
        "context; above the model's: refused at start")] = 0
    sglang_chunked_prefill_size_tokens: Annotated[int, _d(
        "engine sglang: prompt tokens one prefill step takes at most (launch_server --chunked-prefill-size); "
        "0: SGLang's choice by GPU; -1: no chunking")] = 0
    sglang_disable_radix_cache: Annotated[bool, _d(
        "engine sglang: turn off SGLang's prefix (radix) cache (launch_server --disable-radix-cache)")] = False
    sglang_disable_cuda_graph: Annotated[bool, _d(
        "engine sglang: run decode steps without CUDA graphs (launch_server --disable-cuda-graph): starts "
        "faster, decodes slower")] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.sglang_mem_fraction_static < 1.0:
            raise ValueError(f"sglang_mem_fraction_static must be in (0, 1), or 0 for SGLang's choice; "
                             f"got {self.sglang_mem_fraction_static}")
        for name in ("sglang_max_running_requests", "sglang_context_length_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (SGLang's default) or more; got {getattr(self, name)}")
        if self.sglang_tp_size < 1:
            raise ValueError(f"sglang_tp_size must be 1 or more; got {self.sglang_tp_size}")
        if self.sglang_chunked_prefill_size_tokens < -1:
            raise ValueError("sglang_chunked_prefill_size_tokens must be -1 (no chunking), 0 (SGLang's choice) or "
                             f"more; got {self.sglang_chunked_prefill_size_tokens}")
