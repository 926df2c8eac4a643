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
    # Qwen2.5-VL images as Qwen2-VL's (its videos need their time step, not passed to vLLM yet)
    "vllm": {"qwen2_vl": frozenset({"image", "video"}), "qwen2_5_vl": frozenset({"image"}),
             "llava": frozenset({"image"}), "qwen2_audio": frozenset({"audio"})},
}

# engine -> family -> why that engine cannot serve it (said at start-up)
ENGINE_REFUSALS: dict[str, dict[str, str]] = {
    "vllm": {"llava_next_video": "vLLM's LLaVA-NeXT-Video takes raw frames (pixel_values_videos) only, "
                                 "no video embeddings, and mmfleet's encode stage hands prefill embeddings"},
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
