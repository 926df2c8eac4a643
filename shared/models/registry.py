"""Which model families mmfleet serves, what each takes, and where the model lives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.settings import Settings


@dataclass(frozen=True)
class Family:
    name: str
    image_placeholder: str  # the token the chat template emits once per image
    modalities: frozenset[str]


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("qwen2_vl", "<|image_pad|>", frozenset({"image"})),
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


def resolve_model_path(settings: Settings) -> Path:
    """``settings.model_path`` if given, else the tiny offline demo model (built once, cached)."""
    if settings.model_path:
        path = Path(settings.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model_path {path} has no config.json")
        return path
    from shared.models.qwen2_vl_tiny import ensure_tiny_qwen2_vl

    return ensure_tiny_qwen2_vl(Path(settings.cache_dir) / "models")


def placeholder_token_id(model_dir: str | Path) -> int:
    """The token id that stands for one image position in the language model's prompt
    (``image_token_id`` of the saved ``config.json``): what KV block hashes expand."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    token = config.get("image_token_id", config.get("text_config", {}).get("image_token_id"))
    if token is None:
        raise ValueError(f"config.json at {model_dir} names no image_token_id")
    return int(token)
