"""LLaVA-NeXT images ("anyres") on the split compute path (against generate()): the tiny offline
build tiles each image by its size (``image_sizes``), the preprocessor gives the processor's own
tiles and token count, one encode forward over several images of different tile counts (any
requests), prefill, KV shipped to a second instance, decode — equal to one-process
``generate()`` token for token; the encode half holds no LM weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.base import MediaEmbeds
from shared.engines.llava import LlavaNextCompute
from shared.models.llava_next_tiny import ensure_tiny_llava_next
from shared.models.loading import ENCODER
from shared.models.reference import load_reference, reference_generate
from shared.models.registry import family_of, served_modalities
from tests.conftest import CACHE_DIR
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, _shipped, greedy_decode

SIZES = [(90, 60), (60, 130), (200, 200)]  # (width, height): 5, 3 and 5 tiles; 70, 56, 88 tokens


@pytest.fixture(scope="module")
def next_dir():
    return ensure_tiny_llava_next(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def compute(next_dir):
    return LlavaNextCompute(next_dir)


@pytest.fixture(scope="module")
def decode_compute(next_dir):
    return LlavaNextCompute(next_dir)


@pytest.fixture(scope="module")
def reference(next_dir):
    return load_reference(next_dir)


def image(seed: int, size) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def msgs(n: int, text: str = "What is in the image?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(n)), {"type": "text", "text": text}]}]


def test_preprocessor_is_the_processor(next_dir, compute):
    assert family_of(next_dir).name == "llava_next"
    assert served_modalities(family_of(next_dir), "vllm") == {"image"}  # from these embeddings
    counts = []
    for size in SIZES:
        img = image(1, size)
        px = compute.preprocess_image(img)
        text = compute.processor.apply_chat_template(msgs(1), tokenize=False, add_generation_prompt=True)
        full = compute.processor(text=[text], images=[img], return_tensors="pt")
        assert torch.equal(px.pixel_values, full["pixel_values"][0])
        assert list(px.meta) == full["image_sizes"][0].tolist() == [size[1], size[0]]
        fake = [MediaEmbeds(torch.zeros(px.n_tokens, compute.hidden_size), (0, 0, 0))]
        assert compute.expand_prompt(compute.render_prompt_ids(msgs(1)), fake) == full["input_ids"][0].tolist()
        counts.append(px.n_tokens)
    assert len(set(counts)) == len(SIZES)  # the count follows the image's size


@pytest.mark.parametrize("n", [0, 1, 2], ids=["text", "one_image", "two_images"])
def test_split_path_matches_generate(next_dir, compute, decode_compute, reference, n):
    imgs = [image(10 + i, SIZES[i]) for i in range(n)]
    expected = reference_generate(next_dir, msgs(n), imgs, MAX_NEW_TOKENS, loaded=reference)
    mine = [compute.preprocess_image(im) for im in imgs]
    other = compute.preprocess_image(image(99, SIZES[2]))
    feats = compute.encode_media([other, *mine])[1:]  # batched with another request's image
    prefill = compute.prefill(compute.render_prompt_ids(msgs(n)), [MediaEmbeds(f, (0, 0, 0)) for f in feats])
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected and len(set(got)) > 1


def test_encoder_half_has_no_lm(next_dir, compute):
    enc = LlavaNextCompute(next_dir, parts=frozenset({ENCODER}))
    tops = {n.split(".")[1] for n, _ in enc.model.named_parameters()}
    assert tops == {"vision_tower", "multi_modal_projector", "image_newline"}
    px = [enc.preprocess_image(image(3, s)) for s in SIZES[:2]]
    for a, b in zip(enc.encode_media(px), compute.encode_media(px)):
        assert torch.equal(a, b)
