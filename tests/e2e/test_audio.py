"""Qwen2-Audio end to end: the tiny offline Qwen2-Audio served by ``mmfleet up`` (e-p-d: audio
decoded and turned into features by media-fetch, the audio tower in encode, prefill and decode
apart), driven by the official ``openai`` client. At temperature 0 the fleet's text equals the
same model's in-process ``generate()`` on the same decoded samples. Clips are synthesised here."""

from __future__ import annotations

import base64

import openai
import pytest

from shared.media.audio import decode_audio
from shared.models.reference import reference_generate
from tests import procs
from tests.conftest import CACHE_DIR
from tests.media import samples

MAX_TOKENS = 10
QUESTION = "What is this sound?"


@pytest.fixture(scope="module")
def audio_model_dir():
    from shared.models.qwen2_audio_tiny import ensure_tiny_qwen2_audio

    return ensure_tiny_qwen2_audio(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def client(kafka_bootstrap, redis_url, audio_model_dir, tmp_path_factory):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(audio_model_dir),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": "audio",
           "MMFLEET_MAX_AUDIO_DURATION_S": "10",
           # this fleet's processes start as their own `python -m` (shared/process/zygote.py)
           "MMFLEET_ZYGOTE": "false"}
    with procs.fleet(env, tmp_path_factory.mktemp("audio-fleet-logs")) as (base, proc):
        kids = [procs.argv_of(k) for k in procs.children_of(proc.pid)]
        assert sum("--stages" in argv for argv in kids) == 3, kids
        assert not any("shared.process.zygote_main" in argv for argv in kids), kids
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def expected_text(model_dir, raw: bytes, n: int = 1) -> str:
    from transformers import AutoTokenizer

    samples_16k = decode_audio(raw, rate_hz=16_000, max_duration_s=10, param="p")
    messages = [{"role": "user", "content": [*({"type": "audio"} for _ in range(n)),
                                             {"type": "text", "text": QUESTION}]}]
    ids = reference_generate(model_dir, messages, [], MAX_TOKENS, audios=[samples_16k] * n)
    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def ask(client, parts, **kw):
    return client.chat.completions.create(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], **kw)


def input_audio(raw: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}


def test_input_audio_matches_reference_generate(client, audio_model_dir):
    raw = samples.wav(1.2, rate=22_050, freq=330.0)
    expected = expected_text(audio_model_dir, raw)
    assert ask(client, [input_audio(raw)]).choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, [input_audio(raw)], stream=True)
                       if c.choices)
    assert streamed == expected
    other = samples.wav(0.7, rate=16_000, freq=1800.0)
    assert ask(client, [input_audio(other)]).choices[0].message.content == expected_text(audio_model_dir, other)
    assert expected_text(audio_model_dir, other) != expected


def test_audio_url_data_and_two_clips(client, audio_model_dir):
    raw = samples.wav(0.8, rate=8_000, freq=600.0)
    url = "data:audio/wav;base64," + base64.b64encode(raw).decode()
    parts = [{"type": "audio_url", "audio_url": {"url": url}}, input_audio(raw)]
    assert ask(client, parts).choices[0].message.content == expected_text(audio_model_dir, raw, n=2)


@pytest.mark.parametrize("part, fragment", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     "does not accept image input (image_url parts); it accepts text, audio"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}, "does not accept video input"),
    (input_audio(samples.wav(0.5, freq=0.0)), "the audio is silent"),
    (input_audio(b"\x00garbage" * 40, "mp3"), "not a recognised audio file"),
    (input_audio(samples.wav(12.0, rate=8_000)), "above the limit of 10 s"),
])
def test_bad_audio_requests(client, part, fragment):
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, [part])
    err = info.value.body if isinstance(info.value.body, dict) else {}
    assert info.value.status_code in (400, 413) and fragment in str(err.get("message", err)), info.value.body
    assert ask(client, []).choices[0].message.content is not None  # text-only still served


def test_text_only_matches_reference(client, audio_model_dir):
    from transformers import AutoTokenizer

    ids = reference_generate(audio_model_dir, [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                             [], MAX_TOKENS)
    expected = AutoTokenizer.from_pretrained(audio_model_dir).decode(ids, skip_special_tokens=True)
    assert ask(client, []).choices[0].message.content == expected


def test_audio_embeds_answer_like_the_clip(client, audio_model_dir):
    """The model's own audio-tower output for a clip, sent as vLLM clients send it (a base64
    torch.save tensor, alone or in the dict form with audio_num_tokens), gets the clip's answer."""
    from shared.engines.qwen2_audio import Qwen2AudioCompute
    from tests.media.embeds_blobs import b64, torch_blob

    raw = samples.wav(0.9, rate=16_000, freq=500.0)
    compute = Qwen2AudioCompute(audio_model_dir)
    (emb,) = compute.encode_media([compute.preprocess_audio(decode_audio(raw, rate_hz=16_000, max_duration_s=10,
                                                                          param="p"))])
    by_clip = ask(client, [input_audio(raw)]).choices[0].message.content
    for form in (b64(torch_blob(emb)), {"audio_embeds": b64(torch_blob(emb)), "audio_num_tokens": [emb.shape[0]]}):
        assert ask(client, [{"type": "audio_embeds", "audio_embeds": form}]).choices[0].message.content == by_clip
    wrong = {"audio_embeds": b64(torch_blob(emb)), "audio_num_tokens": [emb.shape[0] + 1]}
    with pytest.raises(openai.BadRequestError, match="audio_num_tokens") as info:
        ask(client, [{"type": "audio_embeds", "audio_embeds": wrong}])
    assert info.value.body["param"] == "messages[0].content[0]"
