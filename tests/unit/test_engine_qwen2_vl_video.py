"""Qwen2-VL video on the split compute path: the video preprocessor equals AutoProcessor's
``videos=``, images and videos of several requests share one encode call, and prefill (video
placeholders, M-RoPE over video grids) + decode on a second instance reproduce ``generate()``
token for token. Frames are generated here and go through a real encode/decode with PyAV."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.base import MediaEmbeds
from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.media.video import VideoLimits, decode_video
from shared.models.reference import load_reference, reference_generate
from tests.media import samples
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, _shipped, greedy_decode

LIMITS = VideoLimits(max_duration_s=60, max_frames=16, max_side=1024, max_decoded_frames=1000)


@pytest.fixture(scope="module")
def compute(model_dir):
    return Qwen2VLCompute(model_dir)


@pytest.fixture(scope="module")
def decode_compute(model_dir):
    return Qwen2VLCompute(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def clip(seed: int, n: int = 4, size=(96, 64)) -> np.ndarray:
    raw = samples.video(samples.video_frames(12, size=size, seed=seed), fps=6)
    return decode_video(raw, num_frames=n, fps=0, limits=LIMITS, param="p")


def msgs(parts: list[str], text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": p} for p in parts), {"type": "text", "text": text}]}]


def test_video_preprocessor_matches_processor(compute):
    frames = clip(1, n=5)
    px = compute.preprocess_video(frames)
    text = compute.processor.apply_chat_template(msgs(["video"]), tokenize=False, add_generation_prompt=True)
    full = compute.processor(text=[text], videos=[frames], return_tensors="pt")
    assert torch.equal(px.pixel_values, full["pixel_values_videos"])
    assert [list(px.grid_thw)] == full["video_grid_thw"].tolist() and px.grid_thw[0] == 3  # 5 frames -> 3 t-patches
    fake = [MediaEmbeds(torch.zeros(px.n_tokens, compute.hidden_size), px.grid_thw, "video")]
    assert compute.expand_prompt(compute.render_prompt_ids(msgs(["video"])), fake) == full["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="placeholders"):  # a video's embeddings at an image placeholder
        compute.expand_prompt(compute.render_prompt_ids(msgs(["image"])), fake)


@pytest.mark.parametrize("layout", [["video"], ["image", "video"], ["video", "image", "video"]])
def test_split_path_matches_generate_with_video(model_dir, compute, decode_compute, reference, layout):
    videos = [clip(seed) for seed in range(layout.count("video"))]
    images = [Image.fromarray(np.random.default_rng(9).integers(0, 256, (56, 84, 3), dtype=np.uint8))
              for _ in range(layout.count("image"))]
    expected = reference_generate(model_dir, msgs(layout), images, MAX_NEW_TOKENS, loaded=reference, videos=videos)

    vids, imgs = iter(videos), iter(images)
    mine = [compute.preprocess_video(next(vids)) if kind == "video" else compute.preprocess_image(next(imgs))
            for kind in layout]
    mine = [type(p)(p.pixel_values, p.grid_thw, p.n_tokens, kind) for p, kind in zip(mine, layout)]
    other = compute.preprocess_video(clip(7, n=2))
    other = type(other)(other.pixel_values, other.grid_thw, other.n_tokens, "video")
    feats = compute.encode_media([other, *mine, other])[1:-1]  # batched with another request's items
    items = [MediaEmbeds(f, p.grid_thw, p.kind) for f, p in zip(feats, mine)]
    prefill = compute.prefill(compute.render_prompt_ids(msgs(layout)), items)
    assert prefill.rope_delta != 0
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected
    assert len(set(got)) > 1, "degenerate model: one token repeated"


def test_different_videos_give_different_tokens(model_dir, reference):
    a = reference_generate(model_dir, msgs(["video"]), [], MAX_NEW_TOKENS, loaded=reference, videos=[clip(1)])
    b = reference_generate(model_dir, msgs(["video"]), [], MAX_NEW_TOKENS, loaded=reference, videos=[clip(2)])
    assert a != b
