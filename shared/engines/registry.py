"""The one engine registry: which class an ``engine`` setting names, what it can do
(:func:`engine_capabilities`, read without starting it), and how a worker running a set of
stages builds it (:func:`make_engine`): the model parts its stages load (:func:`parts_for`), the
role each stage gives it (a transformers decode core
for a decode-only worker; a vLLM KV producer for prefill apart from decode, a consumer for decode
apart). Stages, modes and the supervisor ask here, never by engine name themselves.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import socket

from shared.engines.base import Engine
from shared.models.loading import ALL_PARTS, ENCODER, LM
from shared.process.device import resolve_placement
from shared.settings import Settings

ENGINES = ("transformers", "vllm", "sglang")


def engine_class(name: str) -> type[Engine]:
    """The engine class named by the ``engine`` setting (imported only when asked for)."""
    if name == "transformers":
        from shared.engines.transformers_engine import TransformersEngine

        return TransformersEngine
    if name == "vllm":
        from shared.engines.vllm_engine import VllmEngine

        return VllmEngine
    if name == "sglang":
        from shared.engines.sglang_engine import SglangEngine

        return SglangEngine
    raise SystemExit(f"unknown engine {name!r}; choose {', '.join(ENGINES)}")


def uses_decode_core(settings: Settings, stages: tuple[str, ...]) -> bool:
    """The LM decodes in this worker and nothing else: its decode runs in a core process."""
    decode_only = "decode" in stages and not {"prefill", "encode"} & set(stages)
    return settings.engine == "transformers" and settings.decode_core and decode_only


def parts_for(stages: tuple[str, ...], engine: str = "transformers") -> frozenset[str]:
    """What a worker's transformers engine needs: ``ENCODER`` for the encode stage, ``LM`` for
    prefill / decode when the LM engine is transformers, both for a worker with no stages named
    (an in-process server, a reference)."""
    if not stages:
        return ALL_PARTS
    parts = set()
    if "encode" in stages:
        parts.add(ENCODER)
    if engine == "transformers" and {"prefill", "decode"} & set(stages):
        parts.add(LM)
    return frozenset(parts) or ALL_PARTS


def make_engine(name: str, settings: Settings, model_dir, stages: tuple[str, ...] = (), spawner=None) -> Engine:
    """The engine for a worker running ``stages``: a vLLM engine running prefill apart from
    decode is built as KV producer, one running decode apart as KV consumer (vllm_pd). A
    transformers decode core is forked by ``spawner`` (a ``shared.process.zygote.Zygote``) when given.
    A vLLM engine gets the ``vllm_*`` settings and its per-modality limits from the media settings."""
    cls = engine_class(name)
    if name == "transformers" and uses_decode_core(settings, stages):
        from shared.engines.decode_core import CoreDecodeEngine

        return CoreDecodeEngine(model_dir, device=settings.device, dtype=settings.dtype,
                                max_batch=settings.decode_max_batch, torch_threads=settings.torch_threads,
                                spawner=spawner)
    if name == "transformers":
        return cls(model_dir, encode_max_batch_items=settings.encode_max_batch_items,
                   encode_batch_wait_ms=settings.encode_batch_wait_ms, device=settings.device, dtype=settings.dtype,
                   decode_max_batch=settings.decode_max_batch,
                   prefill_max_batch=settings.prefill_max_batch, parts=parts_for(stages, settings.engine),
                   inline_max_ms=settings.compute_inline_max_ms)
    if name == "sglang":  # generate only (epd, e-pd): no role to give it
        placement = resolve_placement(settings.device, settings.dtype)
        return cls(model_dir, serving=settings, max_media_items=settings.max_media_items,
                   device=str(placement.device), dtype=str(placement.dtype).removeprefix("torch."))
    from shared.engines import vllm_config, vllm_pd

    role = None
    if "prefill" in stages and "decode" not in stages:
        role = vllm_pd.PRODUCER
    elif "decode" in stages and "prefill" not in stages:
        role = vllm_pd.CONSUMER
    host = settings.vllm_kv_host
    if host == "auto":
        host = socket.gethostbyname(socket.gethostname())
    placement = resolve_placement(settings.device, settings.dtype)
    # one GPU: pinned (cuda:N); tensor parallel: every GPU this worker sees (device cuda)
    device = str(placement.device) if settings.vllm_tensor_parallel_size == 1 else placement.device.type
    return cls(model_dir, serving=settings, max_media_items=settings.max_media_items,
               mm_limits=vllm_config.mm_limits(settings), kv_role=role, kv_host=host,
               kv_lease_s=max(1, settings.lease_ttl_ms // 1000), kv_block_size=settings.kv_block_size,
               device=device, dtype=str(placement.dtype).removeprefix("torch."),
               kv_buffer_device=settings.vllm_kv_buffer_device)


def engine_capabilities(name: str):
    """Capabilities without starting the engine (for start-up checks)."""
    return engine_class(name).capabilities
