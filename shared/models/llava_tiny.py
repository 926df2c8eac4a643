"""Tiny random-weight LLaVA (CLIP vision tower + MLP projector + Qwen2 LM), built offline.
``build_tiny_llava(out_dir, seed=0)`` writes a directory ``AutoProcessor`` and
``LlavaForConditionalGeneration`` load under ``HF_HUB_OFFLINE=1``; ``ensure_tiny_llava(cache_root)``
builds once into ``cache_root/llava-tiny-<recipe hash>``. Model facts: ``<image>`` registered as
a special token, one per image part of the Qwen-style chat template; images resized and
centre-cropped to 56x56; vision tower 2 layers, hidden 64, patch 14 → 16 LM tokens per image (CLS
dropped); text model as the other tiny builds (hidden 128, 2 layers, plain RoPE). Weights are
kept in the hub layout (:mod:`shared.models.weight_layout`), which transformers and vLLM both load.

Design: docs/guide/models.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from shared.models import build_cache, weight_layout
from shared.models import qwen2_vl_tiny as vl
from shared.models import tokenizer_build as tb
from shared.models.build_cache import build_once

MODEL_NAME = "llava-tiny"
IMAGE = "<image>"
IMAGE_SIZE = 56
PATCH = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2

CHAT_TEMPLATE = tb.CHAT_TEMPLATE.replace("'<|vision_start|><|image_pad|><|vision_end|>'", "'<image>'")


def recipe_hash(seed: int) -> str:
    return build_cache.recipe_hash(seed, (Path(__file__), Path(tb.__file__), Path(vl.__file__),
                                         Path(weight_layout.__file__)))


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    vl.init_weights_fan_in(model, seed, ("embed_tokens", "position_embedding", "class_embedding"))


def build_tiny_llava(out_dir: Path, *, seed: int = 0) -> Path:
    from transformers import (
        CLIPImageProcessor,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (*tb.SPECIAL_TOKENS, IMAGE)}
    if len(set(ids.values())) != len(ids):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    text = vl.text_config_dict(len(tokenizer), ids)
    text.pop("rope_parameters")
    text.update(model_type="qwen2", rope_theta=10000.0)
    config = LlavaConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SIZE,
                       "patch_size": PATCH, "projection_dim": 64},
        text_config=text, image_token_id=ids[IMAGE], vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tb.ENDOFTEXT], eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
        pad_token_id=ids[tb.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out_dir)
    weight_layout.save_in_hub_layout(out_dir, "llava")
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_llava(cache_root: Path, *, seed: int = 0) -> Path:
    """``cache_root/llava-tiny-<hash>``, built once (race-safe as ensure_tiny_qwen2_vl)."""
    return ensure_built(cache_root, MODEL_NAME, build_tiny_llava, [], seed=seed)


def ensure_built(cache_root: Path, name: str, build, recipe_files: list[Path], *, seed: int = 0) -> Path:
    """``cache_root/<name>-<hash of this recipe + recipe_files>``, built once by ``build(dir, seed=)``
    in a temp dir and renamed into place (a process that loses the race uses the winner's)."""
    cache_root = Path(cache_root)
    h = hashlib.sha256(recipe_hash(seed).encode())
    for f in recipe_files:
        h.update(Path(f).read_bytes())
    final = cache_root / f"{name}-{h.hexdigest()[:12]}"
    return build_once(final, lambda d: build(d, seed=seed), seed=seed)
