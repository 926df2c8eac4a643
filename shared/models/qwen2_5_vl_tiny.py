"""Tiny random-weight Qwen2.5-VL, built offline, as :mod:`shared.models.qwen2_vl_tiny` builds
Qwen2-VL (same tokenizer, text model, processors and weight recipe): ``build_tiny_qwen2_5_vl``,
``ensure_tiny_qwen2_5_vl`` → ``cache_root/qwen2.5-vl-tiny-<hash>``. What differs, and is
exercised here: the vision tower's window attention (``window_size`` 56 px = 2×2 merged tokens,
so every test image spans several windows; block 0 windowed, block 1 full attention), RMSNorm +
gated MLP in the tower, and video M-RoPE advancing by ``tokens_per_second · second_per_grid_t``.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models import build_cache
from shared.models import qwen2_vl_tiny as vl
from shared.models import tokenizer_build as tb
from shared.models.build_cache import build_once

MODEL_NAME = "qwen2.5-vl-tiny"
WINDOW_SIZE = 56  # pixels: 2x2 merged tokens per attention window
# with the processor's default 24 fps, a temporal patch (2 frames) spans 1/12 s: 24 tokens per
# second moves the time axis by 2 per patch, so a wrong time step changes positions (and tokens)
TOKENS_PER_SECOND = 24


def recipe_hash(seed: int) -> str:
    return build_cache.recipe_hash(seed, (Path(__file__), Path(vl.__file__), Path(tb.__file__)))


def vision_config_dict(size: vl.Qwen2VLSize = vl.TINY) -> dict:
    return {
        "depth": size.vision_depth,
        "hidden_size": size.vision_embed,
        "intermediate_size": size.vision_embed * size.vision_mlp_ratio,
        "num_heads": size.vision_heads,
        "out_hidden_size": size.text_hidden,  # the merger projects into the LM's hidden size
        "patch_size": vl.PATCH_SIZE,
        "spatial_merge_size": vl.MERGE_SIZE,
        "temporal_patch_size": vl.TEMPORAL_PATCH_SIZE,
        "window_size": WINDOW_SIZE,
        "fullatt_block_indexes": [size.vision_depth - 1],
        "tokens_per_second": TOKENS_PER_SECOND,
        "in_channels": 3,
    }


def build_tiny_qwen2_5_vl(out_dir: Path, *, seed: int = 0) -> Path:
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    size = vl.TINY
    tokenizer = tb.build_qwen2_tokenizer(seed=seed)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in tb.SPECIAL_TOKENS}
    if len(set(ids.values())) != len(ids):
        raise RuntimeError(f"special tokens not registered distinctly: {ids}")
    pixel_kwargs = {"size": {"shortest_edge": vl.MIN_PIXELS, "longest_edge": vl.MAX_PIXELS},
                    "patch_size": vl.PATCH_SIZE, "temporal_patch_size": vl.TEMPORAL_PATCH_SIZE,
                    "merge_size": vl.MERGE_SIZE}
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixel_kwargs), tokenizer=tokenizer,
                                    video_processor=Qwen2VLVideoProcessor(**pixel_kwargs),
                                    chat_template=tb.CHAT_TEMPLATE)
    config = Qwen2_5_VLConfig(
        text_config=vl.text_config_dict(len(tokenizer), ids, size), vision_config=vision_config_dict(size),
        image_token_id=ids[tb.IMAGE_PAD], video_token_id=ids[tb.VIDEO_PAD],
        vision_start_token_id=ids[tb.VISION_START], vision_end_token_id=ids[tb.VISION_END],
        bos_token_id=ids[tb.ENDOFTEXT], eos_token_id=ids[tb.IM_END], pad_token_id=ids[tb.ENDOFTEXT],
        tie_word_embeddings=False)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    vl._init_weights(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=ids[tb.ENDOFTEXT],
                                               eos_token_id=[ids[tb.IM_END], ids[tb.ENDOFTEXT]],
                                               pad_token_id=ids[tb.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_qwen2_5_vl(cache_root: Path, *, seed: int = 0) -> Path:
    final = Path(cache_root) / f"{MODEL_NAME}-{recipe_hash(seed)}"
    return build_once(final, lambda d: build_tiny_qwen2_5_vl(d, seed=seed), seed=seed)
