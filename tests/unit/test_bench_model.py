"""The bench-size Qwen2-VL (``demo_model=qwen2-vl:bench``): its shapes, and greedy parity of the
split path (batched encode, prefill, KV shipped to a second instance, decode) with ``generate()``.

Built once per checkout under ``.mmfleet/cache`` like the tiny model (~25 s the first time on
the dev machine, mostly the tokenizer training; a 20 MB model); the tests then take ~10 s.
Its compute proportions are a benchmark figure (``python -m loadtest split``), not a test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.models.qwen2_vl_tiny import BENCH, TINY, ensure_tiny_qwen2_vl
from shared.models.reference import load_reference, reference_generate
from shared.models.registry import resolve_model_path
from shared.settings import Settings
from tests.conftest import CACHE_DIR

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def bench_dir():
    return ensure_tiny_qwen2_vl(CACHE_DIR / "models", size=BENCH)


@pytest.fixture(scope="module")
def compute(bench_dir):
    return Qwen2VLCompute(bench_dir)


def _image(side_w: int, side_h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side_h, side_w, 3), dtype=np.uint8))


def test_demo_setting_resolves_to_the_bench_build(bench_dir):
    settings = Settings(demo_model="qwen2-vl:bench", cache_dir=str(CACHE_DIR))
    assert resolve_model_path(settings) == bench_dir
    assert bench_dir.name.startswith("qwen2-vl-bench-")


def test_shapes(compute):
    text, vision = compute.model.config.text_config, compute.model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (256, 4, 768)
    assert (compute.head_dim, compute.n_kv_heads) == (BENCH.head_dim, 2) == (64, 2)  # vLLM CPU head size
    assert sum(BENCH.mrope_section) == BENCH.head_dim // 2
    assert (vision.depth, vision.embed_dim) == (BENCH.vision_depth, BENCH.vision_embed)
    assert compute.max_model_len == BENCH.max_positions
    # a 448² image is 256 LM tokens, as in Qwen2-VL-2B (the tiny model caps images at 64)
    assert compute.preprocess_image(_image(448, 448, 0)).n_tokens == 256
    vision_params = sum(p.numel() for n, p in compute.model.named_parameters() if "visual" in n)
    assert vision_params > 1_000_000 and BENCH != TINY


def test_split_path_matches_generate(bench_dir, compute):
    """One 448x336 image (192 tokens) encoded in a batch with another request's image."""
    img = _image(448, 336, 1)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]}]
    expected = reference_generate(bench_dir, msgs, [img], MAX_NEW_TOKENS, loaded=load_reference(bench_dir))

    mine, other = compute.preprocess_image(img), compute.preprocess_image(_image(224, 224, 2))
    feats = compute.encode_media([other, mine])
    prefill = compute.prefill(compute.render_prompt_ids(msgs), [(feats[1], mine.grid_thw)])
    decoder = Qwen2VLCompute(bench_dir)  # a second instance, as a decode worker would be
    state = decoder.start_decode(prefill.kv.clone(), prefill.rope_delta, prefill.prompt_len)
    got = [int(prefill.last_logits.argmax())]
    while len(got) < MAX_NEW_TOKENS and got[-1] not in decoder.eos_token_ids:
        got.append(int(decoder.decode_step(state, got[-1]).argmax()))
    assert got == expected
    assert len(set(got)) > 1, "degenerate model: one token repeated"
    assert torch.isfinite(prefill.last_logits).all()
