"""The media-fetch stage: its topic, its message and how a worker builds its handler.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging

from shared import protocol
from shared.keys import TOPIC_ENCODE, TOPIC_MEDIA_FETCH, TOPIC_PREFILL
from shared.models.registry import family_of, raw_modalities, served_modalities
from shared.stage import StageBuild, StageParts, StageSpec

log = logging.getLogger(__name__)


def _hidden_size(model_dir) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "text_config", config).hidden_size)


def _preprocessors(model_dir, served: frozenset[str], raw: frozenset[str] = frozenset()) -> dict:
    """modality -> the model's own processor for it (no weights), for the modalities served;
    ``raw``: modalities handed on as decoded (the LM engine's own processor takes them)."""
    out: dict = {}
    family = family_of(model_dir).name
    if family == "qwen2_audio":
        from shared.engines.qwen2_audio import AudioPreprocessor

        out["audio"] = AudioPreprocessor(model_dir)
    elif family == "llava":
        from shared.engines.llava import LlavaImagePreprocessor

        out["image"] = LlavaImagePreprocessor(model_dir)
    elif family == "llava_next":
        from shared.engines.llava import NextImagePreprocessor

        out["image"] = NextImagePreprocessor(model_dir, raw="image" in raw)
    elif family == "llava_next_video":
        from shared.engines.llava import NextVideoPreprocessor

        out["video"] = NextVideoPreprocessor(model_dir, raw="video" in raw)
    else:
        from shared.engines.qwen2_vl import ImagePreprocessor, VideoPreprocessor

        out["image"] = ImagePreprocessor(model_dir)
        if "video" in served and family == "qwen2_5_vl":
            from shared.engines.qwen2_5_vl import VideoPreprocessor as Qwen25VideoPreprocessor

            out["video"] = Qwen25VideoPreprocessor(model_dir)
        elif "video" in served:
            out["video"] = VideoPreprocessor(model_dir)
    return {m: p for m, p in out.items() if m in served}


async def build(parts: StageParts) -> StageBuild:
    from services.media_fetch.handler import MediaFetchHandler
    from shared.media.fetch import MediaFetcher
    from shared.process.compute import ComputeLane

    settings, model_dir = parts.settings, parts.model_dir
    fetcher = await parts.stack.enter_async_context(MediaFetcher.from_settings(settings))
    lane = ComputeLane("media", inline_max_ms=settings.compute_inline_max_ms)  # decoding is CPU work wherever
    parts.stack.callback(lane.close)
    fingerprint = ""
    if parts.index is not None:
        from shared.embcache.identity import model_fingerprint

        fingerprint = await asyncio.to_thread(model_fingerprint, model_dir)
    raw = raw_modalities(family_of(model_dir), settings.engine)
    pre = _preprocessors(model_dir, served_modalities(family_of(model_dir), settings.engine), raw)
    if raw:
        log.info("media-fetch hands %s items on as raw media (decoded, not preprocessed; no embedding cache "
                 "for them): the %s engine processes them itself", ", ".join(sorted(raw)), settings.engine)
    return StageBuild(MediaFetchHandler(settings, fetcher, pre.get("image"), lane,
                                        preprocess_video=pre.get("video"), preprocess_audio=pre.get("audio"),
                                        embeds_hidden_size=_hidden_size(model_dir) if pre else 0,
                                        index=parts.index, fingerprint=fingerprint,
                                        # Qwen2.5-VL's video time step is not in an index entry
                                        index_shortcut_kinds=frozenset({"image"})
                                        if family_of(model_dir).name == "qwen2_5_vl"
                                        else frozenset({"image", "video"}),
                                        encode_here="encode" in parts.stages, raw_kinds=raw))


SPEC = StageSpec(name="media-fetch", topic=TOPIC_MEDIA_FETCH, message=protocol.MediaFetchRequest,
                 produces=(TOPIC_ENCODE, TOPIC_PREFILL), part="e", build=build)
