"""Which model families mmfleet serves, what each takes, and where the model lives.

One place says which modalities each family takes (``Family.placeholders``: modality → the
token its chat template emits once per item, expanded by prefill to the item's token count),
and which of them each engine can serve (``ENGINE_SUPPORT``). The gateway refuses a request
whose modality the served model does not take (400); a worker refuses at start-up an engine
that cannot serve the family at all.

Design: docs/guide/models.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.settings import Settings


@dataclass(frozen=True)
class Family:
    name: str
    # modality -> placeholder token, in a fixed order; the keys are the modalities it takes
    placeholders: dict[str, str] = field(default_factory=dict)

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(self.placeholders)

    @property
    def image_placeholder(self) -> str:
        return self.placeholders.get("image", "")


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("qwen2_vl", {"image": "<|image_pad|>", "video": "<|video_pad|>"}),
    "qwen2_5_vl": Family("qwen2_5_vl", {"image": "<|image_pad|>", "video": "<|video_pad|>"}),
    "qwen2_audio": Family("qwen2_audio", {"audio": "<|AUDIO|>"}),
    "llava": Family("llava", {"image": "<image>"}),
    "llava_next": Family("llava_next", {"image": "<image>"}),  # images, anyres tiling
    "llava_next_video": Family("llava_next_video", {"video": "<video>"}),  # its anyres image path: not served
}

# engine -> family -> the modalities it serves (None: every family, every modality of it)
ENGINE_SUPPORT: dict[str, dict[str, frozenset[str]] | None] = {
    "transformers": None,
    # from precomputed embeddings only (the encode stage stays transformers'): shared.engines.vllm_inputs;
    # Qwen2.5-VL videos with their time step (second_per_grid_ts) beside the embeddings
    "vllm": {"qwen2_vl": frozenset({"image", "video"}), "qwen2_5_vl": frozenset({"image", "video"}),
             "llava": frozenset({"image"}), "qwen2_audio": frozenset({"audio"}),
             "llava_next": frozenset({"image"}), "llava_next_video": frozenset({"video"})},
    # text only: SGLang 0.5.12 computes Qwen-VL's M-RoPE positions from its own processor's
    # output alone, so images given as embeddings get 1-D positions (shared.engines.sglang_inputs
    # maps them; docs/design/sglang-engine.md)
    "sglang": {"qwen2_vl": frozenset(), "qwen2_5_vl": frozenset()},
}

# engine -> family -> why that engine cannot serve it (said at start-up)
ENGINE_REFUSALS: dict[str, dict[str, str]] = {
    "sglang": {f: "the sglang engine is checked on Qwen-VL models only"
               for f in ("qwen2_audio", "llava", "llava_next", "llava_next_video")},
}


def family_of(model_dir: str | Path) -> Family:
    """The family of a saved model, from its ``config.json`` ``model_type``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type", "")
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model type {model_type!r} at {model_dir} is not supported; "
                         f"supported: {', '.join(sorted(FAMILIES))}") from None


def served_modalities(family: Family, engine: str) -> frozenset[str]:
    """What a fleet serving ``family`` with language-model engine ``engine`` accepts.

    Raises ``ValueError`` when the engine cannot serve the family at all (a start-up error)."""
    support = ENGINE_SUPPORT.get(engine)
    if engine not in ENGINE_SUPPORT:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINE_SUPPORT)}")
    if support is None:
        return family.modalities
    if family.name not in support:
        why = ENGINE_REFUSALS.get(engine, {}).get(family.name)
        raise ValueError(f"engine {engine!r} does not serve {family.name} models{f' ({why})' if why else ''}; "
                         f"it serves {', '.join(sorted(support))} (use --engine transformers for {family.name})")
    return family.modalities & support[family.name]


# engine -> family -> the modalities it takes as raw media (its own processor and encoder run on
# them) rather than as our encoder's embeddings: the encode stage passes those items through
# untouched (docs/design/vllm-engine.md, "The raw-media path")
ENGINE_RAW_MEDIA: dict[str, dict[str, frozenset[str]]] = {
    # vLLM's LLaVA-NeXT-Video takes pixel_values_videos only: no video-embedding input; its
    # LLaVA-NeXT takes image embeddings as one fixed-shape batch: images of different token
    # counts in one encoder step fail there (and take its engine core down)
    "vllm": {"llava_next_video": frozenset({"video"}), "llava_next": frozenset({"image"})},
}


# engine -> family -> modality -> items per prompt the engine's model takes at most (vLLM 0.32's
# get_supported_mm_limits): the gateway admits no more (with_item_limits), as vllm serve refuses them
ENGINE_ITEM_LIMITS: dict[str, dict[str, dict[str, int]]] = {
    "vllm": {"llava_next_video": {"video": 1}},
}


def with_item_limits(settings: Settings, family: Family) -> Settings:
    """``settings`` with each ``max_<kind>s_per_request`` lowered to what the engine's model of
    ``family`` takes per prompt (``ENGINE_ITEM_LIMITS``), so such a request is a 400 naming it."""
    import msgspec

    from shared.settings_vllm import MODALITY_LIMITS

    changes = {}
    for kind, cap in ENGINE_ITEM_LIMITS.get(settings.engine, {}).get(family.name, {}).items():
        have = getattr(settings, MODALITY_LIMITS[kind])
        if not have or have > cap:
            changes[MODALITY_LIMITS[kind]] = cap
    return msgspec.structs.replace(settings, **changes) if changes else settings


def raw_modalities(family: Family, engine: str) -> frozenset[str]:
    """The modalities of ``family`` that ``engine`` takes as raw media (decoded pixels, not
    embeddings): media-fetch hands such items on as decoded, encode passes them through."""
    return ENGINE_RAW_MEDIA.get(engine, {}).get(family.name, frozenset()) & served_modalities(family, engine)


def placeholder_ids(family: Family, modalities, tokenizer, where) -> dict[str, int]:
    """modality -> the token id of its placeholder in ``tokenizer`` (the model at ``where``);
    ValueError when the tokenizer lacks one."""
    out: dict[str, int] = {}
    for modality in sorted(modalities):
        token = family.placeholders[modality]
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer at {where} has no {token!r} token")
        out[modality] = int(tid)
    return out


def merge_size(model_dir: str | Path) -> int:
    """Qwen-VL's spatial merge (2 when the config names none): ``t·h·w / merge²`` LM tokens an item."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("vision_config", {}).get("spatial_merge_size", 2))


def _demo_qwen2_vl(cache_root: Path) -> Path:
    from shared.models.qwen2_vl_tiny import ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(cache_root)


def _demo_qwen2_vl_bench(cache_root: Path) -> Path:
    from shared.models.qwen2_vl_tiny import BENCH, ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(cache_root, size=BENCH)


def _demo_qwen2_5_vl(cache_root: Path) -> Path:
    from shared.models.qwen2_5_vl_tiny import ensure_tiny_qwen2_5_vl

    return ensure_tiny_qwen2_5_vl(cache_root)


def _demo_qwen2_audio(cache_root: Path) -> Path:
    from shared.models.qwen2_audio_tiny import ensure_tiny_qwen2_audio

    return ensure_tiny_qwen2_audio(cache_root)


def _demo_llava(cache_root: Path) -> Path:
    from shared.models.llava_tiny import ensure_tiny_llava

    return ensure_tiny_llava(cache_root)


def _demo_llava_next(cache_root: Path) -> Path:
    from shared.models.llava_next_tiny import ensure_tiny_llava_next

    return ensure_tiny_llava_next(cache_root)


def _demo_llava_next_video(cache_root: Path) -> Path:
    from shared.models.llava_next_video_tiny import ensure_tiny_llava_next_video

    return ensure_tiny_llava_next_video(cache_root)


# settings.demo_model -> builder of the tiny offline demo (built once under cache_dir, cached)
DEMOS: dict[str, Callable[[Path], Path]] = {
    "qwen2-vl": _demo_qwen2_vl,
    "qwen2-vl:bench": _demo_qwen2_vl_bench,  # a 2B-class VLM's compute proportions, for benchmarks
    "qwen2.5-vl": _demo_qwen2_5_vl,
    "qwen2-audio": _demo_qwen2_audio,
    "llava": _demo_llava,
    "llava-next": _demo_llava_next,
    "llava-next-video": _demo_llava_next_video,
}


def resolve_model_path(settings: Settings) -> Path:
    """The folder of the model to serve: ``settings.model`` (a local folder, or a hub id found
    offline in the hub cache at ``settings.revision``; see :mod:`shared.models.hub`), else the
    tiny offline demo model named by ``settings.demo_model`` (built once, cached). A model that
    is not there raises :class:`shared.models.hub.ModelNotFound` (a ``ValueError``)."""
    if settings.model:
        from shared.models.hub import resolve_model

        return resolve_model(settings.model, revision=settings.revision, cache_dir=settings.hub_cache_dir)
    build = DEMOS.get(settings.demo_model)
    if build is None:
        raise ValueError(f"unknown demo_model {settings.demo_model!r}; choose from {', '.join(DEMOS)}")
    return build(Path(settings.cache_dir) / "models")


_PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                     "audio_token_id", "audio_token_index")


def placeholder_token_id(model_dir: str | Path) -> frozenset[int]:
    """The token ids that stand for one media position in the language model's prompt (image,
    video, audio: whichever the saved ``config.json`` names, top level or ``text_config``):
    what KV block hashes expand."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    found = set()
    for where in (config, config.get("text_config") or {}):
        found.update(int(where[k]) for k in _PLACEHOLDER_KEYS if where.get(k) is not None)
    if not found:
        raise ValueError(f"config.json at {model_dir} names no media placeholder token")
    return frozenset(found)
