"""Qwen2-VL split compute path against one-process ``generate()`` (against generate()).

Builds the tiny offline model once per session.  The parity test runs the split
path the way the fleet does — batched encode shared with other requests, prefill,
KV packed into one tensor, decode on a SECOND model instance loaded from disk — and
requires exactly the reference tokens.
"""

from __future__ import annotations

import itertools
import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.engines.sampling import Sampler
from shared.models import tokenizer_build as tb
from shared.models.qwen2_vl_tiny import HEAD_DIM, MROPE_SECTION, ensure_tiny_qwen2_vl
from shared.models.reference import load_reference, reference_generate

torch.set_num_threads(1)

MAX_NEW_TOKENS = 12
QUESTION = "What is in the image?"


def make_images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 96).astype(np.uint8)
    return {
        "noise1": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "noise2": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "red": Image.new("RGB", (64, 64), (255, 0, 0)),
        "blue": Image.new("RGB", (64, 64), (0, 0, 255)),
        "hgrad": Image.fromarray(np.stack([np.tile(ramp, (96, 1))] * 3, axis=-1)),
        "vgrad": Image.fromarray(np.stack([np.tile(ramp[:, None], (1, 96))] * 3, axis=-1)),
        "noise_big": Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)),
        "green_big": Image.new("RGB", (320, 240), (10, 200, 30)),
    }


def messages_for(n_images: int, text: str = QUESTION) -> list[dict]:
    if n_images == 0:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return ensure_tiny_qwen2_vl(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def compute(model_dir):
    return Qwen2VLCompute(model_dir)


@pytest.fixture(scope="session")
def decode_compute(model_dir):
    """A second, independent load: decode must not rely on prefill's instance."""
    return Qwen2VLCompute(model_dir)


@pytest.fixture(scope="session")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="session")
def images():
    return make_images()


def greedy_decode(decoder: Qwen2VLCompute, prefill, max_new_tokens: int, rope_delta: int | None = None) -> list[int]:
    """Argmax loop that stops like generate(): after the first eos or max_new_tokens."""
    delta = prefill.rope_delta if rope_delta is None else rope_delta
    state = decoder.start_decode(prefill.kv, delta, prefill.prompt_len)
    tokens = [int(prefill.last_logits.argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in decoder.eos_token_ids:
        tokens.append(int(decoder.decode_step(state, tokens[-1]).argmax()))
    return tokens


# ---- the built model ------------------------------------------------------------


def test_config_ids_come_from_tokenizer(model_dir, compute):
    tok, cfg = compute.tokenizer, compute.model.config
    ids = {t: tok.convert_tokens_to_ids(t) for t in tb.SPECIAL_TOKENS}
    assert cfg.image_token_id == ids[tb.IMAGE_PAD] == compute.placeholder_token_id
    assert cfg.video_token_id == ids[tb.VIDEO_PAD]
    assert cfg.vision_start_token_id == ids[tb.VISION_START]
    assert cfg.vision_end_token_id == ids[tb.VISION_END]
    assert cfg.text_config.eos_token_id == ids[tb.IM_END] == tok.eos_token_id
    assert compute.eos_token_ids == {ids[tb.IM_END], ids[tb.ENDOFTEXT]}
    assert cfg.text_config.vocab_size == len(tok)
    assert compute.head_dim == HEAD_DIM == 32
    assert sum(MROPE_SECTION) == HEAD_DIM // 2
    assert cfg.text_config.rope_parameters["mrope_section"] == MROPE_SECTION


def test_chat_template_renders_qwen_style(compute):
    text = compute.processor.apply_chat_template(messages_for(1, "Hi"), tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_ensure_is_race_safe_and_deterministic(tmp_path, model_dir):
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_qwen2_vl(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] == tmp_path / model_dir.name
    assert [p.name for p in tmp_path.iterdir()] == [model_dir.name]  # no temp dirs left
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (results[0] / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert ensure_tiny_qwen2_vl(tmp_path) == results[0]


# ---- preprocessing and prompt expansion -----------------------------------------


@pytest.mark.parametrize("names", [["noise1"], ["noise1", "green_big"], ["noise_big", "hgrad"]])
def test_preprocess_and_expansion_match_processor(compute, images, names):
    imgs = [images[n] for n in names]
    msgs = messages_for(len(imgs))
    text = compute.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = compute.processor(text=[text], images=imgs, return_tensors="pt")

    pixels = [compute.preprocess_image(im) for im in imgs]
    assert torch.equal(torch.cat([p.pixel_values for p in pixels]), full["pixel_values"])
    assert [list(p.grid_thw) for p in pixels] == full["image_grid_thw"].tolist()
    assert all(4 <= p.n_tokens <= 64 for p in pixels)

    prompt_ids = compute.render_prompt_ids(msgs)
    assert prompt_ids.count(compute.placeholder_token_id) == len(imgs)
    fake = [(torch.zeros(p.n_tokens, compute.hidden_size), p.grid_thw) for p in pixels]
    assert compute.expand_prompt(prompt_ids, fake) == full["input_ids"][0].tolist()


def test_expand_rejects_mismatch(compute, images):
    p = compute.preprocess_image(images["red"])
    prompt_ids = compute.render_prompt_ids(messages_for(1))
    with pytest.raises(ValueError):
        compute.expand_prompt(prompt_ids, [])
    with pytest.raises(ValueError):
        compute.expand_prompt(prompt_ids, [(torch.zeros(p.n_tokens + 1, compute.hidden_size), p.grid_thw)])


def test_batched_encode_equals_single(compute, images):
    pixels = [compute.preprocess_image(images[n]) for n in ("noise1", "green_big", "vgrad")]
    batched = compute.encode_media(pixels)
    for p, b in zip(pixels, batched):
        (single,) = compute.encode_media([p])
        assert b.dtype == torch.float32 and b.is_contiguous() and b.shape == (p.n_tokens, compute.hidden_size)
        torch.testing.assert_close(b, single, rtol=1e-5, atol=1e-5)


# ---- THE parity test --------------------------------------------------------------


@pytest.mark.parametrize("names", [[], ["noise1"], ["noise_big", "hgrad"]], ids=["text", "one_image", "two_images"])
def test_split_path_matches_generate(model_dir, compute, decode_compute, reference, images, names):
    imgs = [images[n] for n in names]
    msgs = messages_for(len(imgs))
    expected = reference_generate(model_dir, msgs, imgs, MAX_NEW_TOKENS, loaded=reference)

    # Encode in a batch shared with other requests' images, then take our slice.
    others_before = [compute.preprocess_image(images["blue"])]
    others_after = [compute.preprocess_image(images["green_big"])]
    mine = [compute.preprocess_image(im) for im in imgs]
    feats = compute.encode_media(others_before + mine + others_after)
    my_feats = feats[len(others_before) : len(others_before) + len(mine)]

    prefill = compute.prefill(compute.render_prompt_ids(msgs), [(f, p.grid_thw) for f, p in zip(my_feats, mine)])
    assert prefill.kv.is_contiguous() and prefill.kv.dtype == torch.float32
    assert prefill.kv.shape == (compute.n_layers, 2, compute.n_kv_heads, prefill.prompt_len, compute.head_dim)
    assert torch.isfinite(prefill.last_logits).all()
    if not imgs:
        assert prefill.rope_delta == 0

    # Ship the KV as bytes-equivalent (a copy) to a second instance, like another process would.
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected
    # Positions were passed explicitly: the shared models' cached M-RoPE offset is untouched.
    assert compute.model.model.rope_deltas is None and decode_compute.model.model.rope_deltas is None
    assert len(set(got)) > 1, "degenerate model: one token repeated"


def _shipped(prefill):
    from dataclasses import replace

    return replace(prefill, kv=prefill.kv.clone())


def test_rope_delta_is_load_bearing(compute, images):
    """Negative control: dropping rope_delta must change the tokens, else parity proves little."""
    pixels = [compute.preprocess_image(images["noise_big"])]
    feats = compute.encode_media(pixels)
    prefill = compute.prefill(compute.render_prompt_ids(messages_for(1)), [(feats[0], pixels[0].grid_thw)])
    assert prefill.rope_delta != 0
    assert greedy_decode(compute, prefill, MAX_NEW_TOKENS) != greedy_decode(compute, prefill, MAX_NEW_TOKENS, 0)


def test_different_images_give_different_tokens(model_dir, reference, images):
    outs = {
        name: reference_generate(model_dir, messages_for(1), [im], MAX_NEW_TOKENS, loaded=reference)
        for name, im in images.items()
    }
    for a, b in itertools.combinations(outs, 2):
        assert outs[a] != outs[b], (a, b)
    for name, toks in outs.items():
        assert len(set(toks)) > 1, name


# ---- sampling ---------------------------------------------------------------------


def test_sampler_greedy_and_seeded(compute):
    prefill = compute.prefill(compute.render_prompt_ids(messages_for(0)), [])
    logits = prefill.last_logits
    assert Sampler(temperature=0.0)(logits) == int(logits.argmax())
    assert Sampler(temperature=1.0, top_p=1e-6, seed=3)(logits) == int(logits.argmax())

    def draw(seed: int) -> list[int]:
        s = Sampler(temperature=1.5, top_p=0.95, seed=seed)
        return [s(logits) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    with pytest.raises(ValueError):
        Sampler(temperature=-1.0)
