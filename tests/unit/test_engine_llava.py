"""LLaVA on the split compute path (against generate()): the tiny offline build, its image
preprocessor as media-fetch runs it, and batched encode → prefill → KV shipped to a second
instance → decode equal to one-process ``generate()`` token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.base import MediaEmbeds
from shared.engines.llava import LlavaCompute
from shared.models.llava_next_video_tiny import TOKENS_PER_FRAME
from shared.models.llava_tiny import TOKENS_PER_IMAGE, ensure_tiny_llava
from shared.models.reference import load_reference, reference_generate
from shared.models.registry import family_of
from tests.conftest import CACHE_DIR
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, _shipped, greedy_decode


@pytest.fixture(scope="module")
def llava_dir():
    return ensure_tiny_llava(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def compute(llava_dir):
    return LlavaCompute(llava_dir)


@pytest.fixture(scope="module")
def decode_compute(llava_dir):
    return LlavaCompute(llava_dir)


@pytest.fixture(scope="module")
def reference(llava_dir):
    return load_reference(llava_dir)


def image(seed: int, size=(90, 60)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def msgs(n: int, text: str = "What is in the image?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(n)), {"type": "text", "text": text}]}]


def test_build_facts(llava_dir, compute):
    assert family_of(llava_dir).name == "llava"
    assert compute.placeholder_token_id == compute.tokenizer.convert_tokens_to_ids("<image>")
    px = compute.preprocess_image(image(1))
    assert px.pixel_values.shape == (3, 56, 56) and px.n_tokens == TOKENS_PER_IMAGE == 16
    text = compute.processor.apply_chat_template(msgs(1), tokenize=False, add_generation_prompt=True)
    full = compute.processor(text=[text], images=[image(1)], return_tensors="pt")
    assert torch.equal(px.pixel_values, full["pixel_values"][0])
    fake = [MediaEmbeds(torch.zeros(16, compute.hidden_size), (0, 0, 0))]
    assert compute.expand_prompt(compute.render_prompt_ids(msgs(1)), fake) == full["input_ids"][0].tolist()


@pytest.mark.parametrize("n", [0, 1, 2], ids=["text", "one_image", "two_images"])
def test_split_path_matches_generate(llava_dir, compute, decode_compute, reference, n):
    imgs = [image(10 + i, size=(80 + 30 * i, 64)) for i in range(n)]
    expected = reference_generate(llava_dir, msgs(n), imgs, MAX_NEW_TOKENS, loaded=reference)
    mine = [compute.preprocess_image(im) for im in imgs]
    feats = compute.encode_media([compute.preprocess_image(image(99)), *mine])[1:]  # batched with others
    prefill = compute.prefill(compute.render_prompt_ids(msgs(n)), [MediaEmbeds(f, (0, 0, 0)) for f in feats])
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected
    assert len(set(got)) > 1


def test_different_images_give_different_tokens(llava_dir, reference):
    a, b = (reference_generate(llava_dir, msgs(1), [image(s)], MAX_NEW_TOKENS, loaded=reference) for s in (1, 2))
    assert a != b


# ---- LLaVA-NeXT-Video ---------------------------------------------------------------


@pytest.fixture(scope="module")
def next_video():
    from shared.engines.llava import LlavaNextVideoCompute
    from shared.models.llava_next_video_tiny import ensure_tiny_llava_next_video

    path = ensure_tiny_llava_next_video(CACHE_DIR / "models")
    return path, LlavaNextVideoCompute(path), LlavaNextVideoCompute(path), load_reference(path)


def frames(seed: int, n: int) -> np.ndarray:
    from shared.media.video import VideoLimits, decode_video
    from tests.media import samples

    raw = samples.video(samples.video_frames(12, size=(96, 64), seed=seed), fps=6)
    return decode_video(raw, num_frames=n, fps=0, limits=VideoLimits(60, 16, 1024, 1000), param="p")


def vmsgs(n: int, text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "video"} for _ in range(n)), {"type": "text", "text": text}]}]


@pytest.mark.parametrize("n_frames", [[4], [3, 3]], ids=["one_video", "two_videos"])  # generate() wants equal counts
def test_next_video_split_path_matches_generate(next_video, n_frames):
    path, compute, decoder, reference = next_video
    videos = [frames(i, n) for i, n in enumerate(n_frames)]
    expected = reference_generate(path, vmsgs(len(videos)), [], MAX_NEW_TOKENS, loaded=reference, videos=videos)
    mine = [compute.preprocess_video(v) for v in videos]
    assert [p.n_tokens for p in mine] == [TOKENS_PER_FRAME * n for n in n_frames] and TOKENS_PER_FRAME == 16
    feats = compute.encode_media([compute.preprocess_video(frames(9, 2)), *mine])[1:]  # batched with others
    prefill = compute.prefill(compute.render_prompt_ids(vmsgs(len(videos))),
                              [MediaEmbeds(f, (0, 0, 0), "video") for f in feats])
    got = greedy_decode(decoder, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected
    assert len(set(got)) > 1
