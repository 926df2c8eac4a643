"""Tiny random-weight LLaVA-NeXT (CLIP tower + projector + Qwen2 LM) for images, with its
"anyres" tiling, built offline. Contract as :mod:`shared.models.llava_tiny`
(``build_tiny_llava_next``, ``ensure_tiny_llava_next`` → ``cache_root/llava-next-tiny-<recipe
hash>``). Model facts: ``<image>`` registered as a special token; tiles of 56×56 (patch 14 → 16
tokens per tile); ``image_grid_pinpoints`` up to 112×112, so an image becomes the resized whole
plus up to 2×2 tiles, unpadded to its aspect ratio with an ``image_newline`` row end.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models import llava_tiny as lt
from shared.models import qwen2_vl_tiny as vl
from shared.models import tokenizer_build as tb
from shared.models import weight_layout

MODEL_NAME = "llava-next-tiny"
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112]]


def build_tiny_llava_next(out_dir: Path, *, seed: int = 0) -> Path:
    from transformers import (
        GenerationConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [lt.IMAGE]})
    tokenizer.chat_template = lt.CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (*tb.SPECIAL_TOKENS, lt.IMAGE)}
    if len(set(ids.values())) != len(ids):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": lt.IMAGE_SIZE},
                                                crop_size={"height": lt.IMAGE_SIZE, "width": lt.IMAGE_SIZE},
                                                image_grid_pinpoints=PINPOINTS),
        tokenizer=tokenizer, patch_size=lt.PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=lt.CHAT_TEMPLATE)
    text = vl.text_config_dict(len(tokenizer), ids)
    text.pop("rope_parameters")
    text.update(model_type="qwen2", rope_theta=10000.0)
    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": lt.IMAGE_SIZE,
                       "patch_size": lt.PATCH, "projection_dim": 64},
        text_config=text, image_token_id=ids[lt.IMAGE], vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS, projector_hidden_act="gelu")
    model = LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
    lt._init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tb.ENDOFTEXT], eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
        pad_token_id=ids[tb.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out_dir)
    weight_layout.save_in_hub_layout(out_dir, "llava_next")  # as llava_tiny
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_llava_next(cache_root: Path, *, seed: int = 0) -> Path:
    return lt.ensure_built(cache_root, MODEL_NAME, build_tiny_llava_next, [Path(__file__)], seed=seed)
