"""Where a checkpoint's weights sit by name: transformers 5 saves a freshly built LLaVA,
LLaVA-NeXT, LLaVA-NeXT-Video or Qwen2-Audio model with some modules nested differently from
the hub's checkpoints (:data:`TRANSFORMERS5_LAYOUTS`); transformers 5 loads either layout to the
same weights, vLLM 0.32's loaders map only the hub's. :func:`save_in_hub_layout` renames a saved
folder's weights to the hub layout, which is how the tiny offline builds are kept, so one
folder serves both engines.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

_CLIP_TOWER = ("vision_tower.embeddings.", "vision_tower.", "vision_tower.vision_model.")

# family -> (a key prefix only transformers-5 saves have, that prefix's part to rewrite, what the
# hub layout has there)
TRANSFORMERS5_LAYOUTS: dict[str, tuple[str, str, str]] = {
    "llava": _CLIP_TOWER,
    "llava_next": _CLIP_TOWER,
    "llava_next_video": _CLIP_TOWER,
    "qwen2_audio": ("language_model.model.model.", "language_model.model.model.", "language_model.model."),
}


def rename_weights(model_dir: Path, old: str, new: str) -> None:
    """Every safetensors file in ``model_dir`` rewritten with the keys starting ``old`` starting
    ``new`` instead (a sharded index, if any, follows)."""
    import json

    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        save_file({new + k[len(old):] if k.startswith(old) else k: v for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {new + k[len(old):] if k.startswith(old) else k: f for k, f in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def save_in_hub_layout(model_dir: Path, family: str) -> None:
    """A folder just written by ``save_pretrained`` put into the hub layout (a no-op for families
    transformers 5 already saves that way)."""
    layout = TRANSFORMERS5_LAYOUTS.get(family)
    if layout is not None:
        rename_weights(model_dir, layout[1], layout[2])
