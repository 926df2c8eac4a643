"""Qwen2.5-VL on the split compute path (against generate()): the tiny offline build (window
attention in its vision tower), images and videos batched with other requests' items through
one encode, prefill with the family's video M-RoPE time step, KV shipped to a second instance,
decode — equal to one-process ``generate()`` token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.base import MediaEmbeds
from shared.engines.qwen2_5_vl import Qwen2_5_VLCompute
from shared.models.qwen2_5_vl_tiny import ensure_tiny_qwen2_5_vl
from shared.models.reference import load_reference, reference_generate
from shared.models.registry import family_of, served_modalities
from tests.conftest import CACHE_DIR
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, _shipped, greedy_decode
from tests.unit.test_engine_qwen2_vl_video import clip, msgs


@pytest.fixture(scope="module")
def q25_dir():
    return ensure_tiny_qwen2_5_vl(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def compute(q25_dir):
    return Qwen2_5_VLCompute(q25_dir)


@pytest.fixture(scope="module")
def decode_compute(q25_dir):
    return Qwen2_5_VLCompute(q25_dir)


@pytest.fixture(scope="module")
def reference(q25_dir):
    return load_reference(q25_dir)


def image(seed: int, size=(120, 90)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_family_and_engines(q25_dir, compute):
    family = family_of(q25_dir)
    assert family.name == "qwen2_5_vl" and family.modalities == {"image", "video"}
    assert type(compute.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert served_modalities(family, "vllm") == {"image", "video"}  # embeddings, videos with their time step
    px = compute.preprocess_image(image(1))
    window_tokens = compute.model.config.vision_config.window_size // 28
    assert px.grid_thw[1] // 2 > window_tokens  # the image spans several attention windows


def test_video_preprocessor_is_the_processor(compute):
    frames = clip(3, n=5)
    px = compute.preprocess_video(frames)
    text = compute.processor.apply_chat_template(msgs(["video"]), tokenize=False, add_generation_prompt=True)
    full = compute.processor(text=[text], videos=[frames], return_tensors="pt")
    assert torch.equal(px.pixel_values, full["pixel_values_videos"])
    assert [list(px.grid_thw)] == full["video_grid_thw"].tolist()
    assert px.second_per_grid_t == float(torch.as_tensor(full["second_per_grid_ts"])[0]) > 0


@pytest.mark.parametrize("layout", [[], ["image"], ["image", "image"], ["video"], ["image", "video"]],
                         ids=["text", "image", "two_images", "video", "image_video"])
def test_split_path_matches_generate(q25_dir, compute, decode_compute, reference, layout):
    videos = [clip(seed) for seed in range(layout.count("video"))]
    images = [image(10 + i, size=(100 + 40 * i, 80)) for i in range(layout.count("image"))]
    messages = msgs(layout) if layout else [{"role": "user", "content": "What happens?"}]
    expected = reference_generate(q25_dir, messages, images, MAX_NEW_TOKENS, loaded=reference, videos=videos)
    vids, imgs = iter(videos), iter(images)
    mine = [compute.preprocess_video(next(vids)) if k == "video" else compute.preprocess_image(next(imgs))
            for k in layout]
    other = compute.preprocess_image(image(99))
    feats = compute.encode_media([other, *mine, other])[1:-1]  # batched with another request's items
    items = [MediaEmbeds(f, p.grid_thw, p.kind, p.second_per_grid_t) for f, p in zip(feats, mine)]
    prefill = compute.prefill(compute.render_prompt_ids(messages), items)
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected and len(set(got)) > 1
    if "video" in layout:  # the time step is load-bearing: another one moves positions; none is refused
        wrong = [MediaEmbeds(it.embeds, it.grid_thw, it.kind, it.second_per_grid_t * 4) for it in items]
        moved = compute.prefill(compute.render_prompt_ids(messages), wrong)
        assert not torch.allclose(moved.last_logits, prefill.last_logits)
        bare = [MediaEmbeds(it.embeds, it.grid_thw, it.kind) for it in items]
        with pytest.raises(ValueError, match="second_per_grid_t"):
            compute.prefill(compute.render_prompt_ids(messages), bare)


def test_a_clips_time_step_is_the_rate_its_frames_were_sampled_at(compute):
    """media-fetch hands the preprocessor the rate it sampled the clip at: one temporal patch
    (2 frames) of a clip sampled at 2 fps spans 1 s of it (the processor alone would assume
    its default 24 fps: 1/12 s, positions 12 times too close)."""
    from shared.media.video import VideoLimits, decode_video_clip
    from tests.media import samples

    raw = samples.video(samples.video_frames(30, size=(64, 48)), fps=10)  # 3 s
    limits = VideoLimits(max_duration_s=60, max_frames=16, max_side=256, max_decoded_frames=1_000)
    at_2fps = decode_video_clip(raw, num_frames=0, fps=2.0, limits=limits, param="p")
    assert (len(at_2fps.frames), at_2fps.sampled_fps) == (6, pytest.approx(2.0))
    px = compute.preprocess_video(at_2fps.frames, fps=at_2fps.sampled_fps)
    assert px.second_per_grid_t == pytest.approx(1.0)
    four = decode_video_clip(raw, num_frames=4, fps=0.0, limits=limits, param="p")  # 4 frames over 3 s
    assert four.sampled_fps == pytest.approx(4 / 3)
    assert compute.preprocess_video(four.frames, fps=four.sampled_fps).second_per_grid_t == pytest.approx(1.5)
    assert compute.preprocess_video(at_2fps.frames).second_per_grid_t == pytest.approx(2 / 24)  # the default


def test_split_path_matches_generate_at_the_clips_own_rate(q25_dir, compute, decode_compute, reference):
    """At 2 fps the video's time axis (12 positions a temporal patch) runs past the text after it:
    decode still continues from the last prompt token's position, as generate() does."""
    from shared.media.video import VideoLimits, decode_video_clip
    from tests.media import samples

    raw = samples.video(samples.video_frames(30, size=(64, 48), seed=3), fps=10)
    limits = VideoLimits(max_duration_s=60, max_frames=16, max_side=256, max_decoded_frames=1_000)
    c = decode_video_clip(raw, num_frames=0, fps=2.0, limits=limits, param="p")
    messages = msgs(["video"])
    expected = reference_generate(q25_dir, messages, [], MAX_NEW_TOKENS, loaded=reference, videos=[c.frames],
                                  video_fps=[c.sampled_fps])
    px = compute.preprocess_video(c.frames, fps=c.sampled_fps)
    items = [MediaEmbeds(compute.encode_media([px])[0], px.grid_thw, px.kind, px.second_per_grid_t)]
    got = greedy_decode(decode_compute, _shipped(compute.prefill(compute.render_prompt_ids(messages), items)),
                        MAX_NEW_TOKENS)
    assert got == expected and len(set(got)) > 1
