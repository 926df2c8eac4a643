"""Qwen2-Audio on the split compute path (against generate()): the tiny offline build, its
feature extractor as media-fetch runs it, and batched encode → prefill → KV shipped to a second
instance → decode equal to one-process ``generate()`` token for token. Clips are synthesised
here and go through a real WAV encode/decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.engines.base import MediaEmbeds
from shared.engines.qwen2_audio import Qwen2AudioCompute, n_audio_tokens
from shared.media.audio import decode_audio
from shared.models.qwen2_audio_tiny import ensure_tiny_qwen2_audio
from shared.models.reference import load_reference, reference_generate
from shared.models.registry import family_of
from tests.conftest import CACHE_DIR
from tests.media import samples
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, _shipped, greedy_decode


@pytest.fixture(scope="module")
def audio_model_dir():
    return ensure_tiny_qwen2_audio(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def compute(audio_model_dir):
    return Qwen2AudioCompute(audio_model_dir)


@pytest.fixture(scope="module")
def decode_compute(audio_model_dir):
    return Qwen2AudioCompute(audio_model_dir)


@pytest.fixture(scope="module")
def reference(audio_model_dir):
    return load_reference(audio_model_dir)


def clip(freq: float, seconds: float = 1.0) -> np.ndarray:
    return decode_audio(samples.wav(seconds, rate=44_100, freq=freq), rate_hz=16_000, max_duration_s=30, param="p")


def msgs(n: int, text: str = "What is this sound?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "audio"} for _ in range(n)), {"type": "text", "text": text}]}]


def test_build_facts(audio_model_dir, compute):
    assert family_of(audio_model_dir).name == "qwen2_audio"
    assert compute.placeholder_token_id == compute.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    px = compute.preprocess_audio(clip(440))
    assert px.pixel_values.shape == (128, 3000) and px.meta == (100,) and px.n_tokens == n_audio_tokens(100) == 25


@pytest.mark.parametrize("freqs", [[440.0], [300.0, 2000.0]], ids=["one_clip", "two_clips"])
def test_split_path_matches_generate(audio_model_dir, compute, decode_compute, reference, freqs):
    audios = [clip(f, seconds=0.5 + i) for i, f in enumerate(freqs)]
    expected = reference_generate(audio_model_dir, msgs(len(audios)), [], MAX_NEW_TOKENS, loaded=reference,
                                  audios=audios)
    mine = [compute.preprocess_audio(a) for a in audios]
    other = compute.preprocess_audio(clip(900, seconds=2.5))
    feats = compute.encode_media([other, *mine])[1:]  # batched with another request's clip
    items = [MediaEmbeds(f, p.grid_thw, "audio") for f, p in zip(feats, mine)]
    prefill = compute.prefill(compute.render_prompt_ids(msgs(len(audios))), items)
    assert prefill.rope_delta == 0
    got = greedy_decode(decode_compute, _shipped(prefill), MAX_NEW_TOKENS)
    assert got == expected
    assert len(set(got)) > 1


def test_different_clips_give_different_tokens(audio_model_dir, reference):
    a, b = (reference_generate(audio_model_dir, msgs(1), [], MAX_NEW_TOKENS, loaded=reference, audios=[clip(f)])
            for f in (440.0, 1500.0))
    assert a != b


def test_expand_rejects_mismatch(compute):
    with pytest.raises(ValueError, match="audio placeholders"):
        compute.expand_prompt(compute.render_prompt_ids(msgs(1)), [])
    with pytest.raises(ValueError):
        compute.encode_media([type(compute.preprocess_audio(clip(440)))(torch.zeros(4, 4), (1, 2, 2), 1)])
