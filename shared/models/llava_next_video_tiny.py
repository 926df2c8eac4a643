"""Tiny random-weight LLaVA-NeXT-Video (CLIP tower + 2x2 average pooling per frame + projector +
Qwen2 LM), built offline; served for video. Contract as :mod:`shared.models.llava_tiny`
(``build_tiny_llava_next_video``, ``ensure_tiny_llava_next_video`` →
``cache_root/llava-next-video-tiny-<recipe hash>``). Model facts: ``<image>`` and ``<video>``
registered as special tokens; a video part renders one ``<video>``; frames are resized (shortest
edge 56) and centre-cropped to 56x56; patch 7 → 8x8 patches, pooled 2x2 → 16 LM tokens per frame
(vLLM's pooler divides by ``image_size // patch²``: a patch of 14 on 56-pixel frames would be 0
there). Weights in the hub layout (:mod:`shared.models.weight_layout`), which vLLM loads.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models import llava_tiny as lt
from shared.models import qwen2_vl_tiny as vl
from shared.models import tokenizer_build as tb
from shared.models import weight_layout

MODEL_NAME = "llava-next-video-tiny"
VIDEO = "<video>"
PATCH = 7
POOL = 2
TOKENS_PER_FRAME = (lt.IMAGE_SIZE // PATCH // POOL) ** 2
CHAT_TEMPLATE = lt.CHAT_TEMPLATE.replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'<video>'")


def build_tiny_llava_next_video(out_dir: Path, *, seed: int = 0) -> Path:
    from transformers import (
        GenerationConfig,
        LlavaNextImageProcessor,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor,
        LlavaNextVideoVideoProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [lt.IMAGE, VIDEO]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (*tb.SPECIAL_TOKENS, lt.IMAGE, VIDEO)}
    if len(set(ids.values())) != len(ids):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")
    size = {"shortest_edge": lt.IMAGE_SIZE}
    crop = {"height": lt.IMAGE_SIZE, "width": lt.IMAGE_SIZE}
    processor = LlavaNextVideoProcessor(
        video_processor=LlavaNextVideoVideoProcessor(size=size, crop_size=crop),
        image_processor=LlavaNextImageProcessor(size=size, crop_size=crop,
                                                image_grid_pinpoints=[[lt.IMAGE_SIZE, lt.IMAGE_SIZE]]),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    text = vl.text_config_dict(len(tokenizer), ids)
    text.pop("rope_parameters")
    text.update(model_type="qwen2", rope_theta=10000.0)
    config = LlavaNextVideoConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": lt.IMAGE_SIZE,
                       "patch_size": PATCH, "projection_dim": 64},
        text_config=text, image_token_id=ids[lt.IMAGE], video_token_id=ids[VIDEO], vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=[[lt.IMAGE_SIZE, lt.IMAGE_SIZE]],
        spatial_pool_mode="average", spatial_pool_stride=POOL)
    model = LlavaNextVideoForConditionalGeneration(config).to(torch.float32).eval()
    lt._init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tb.ENDOFTEXT], eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
        pad_token_id=ids[tb.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out_dir)
    weight_layout.save_in_hub_layout(out_dir, "llava_next_video")  # as llava_tiny
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_llava_next_video(cache_root: Path, *, seed: int = 0) -> Path:
    return lt.ensure_built(cache_root, MODEL_NAME, build_tiny_llava_next_video, [Path(__file__)], seed=seed)
