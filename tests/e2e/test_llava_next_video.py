"""LLaVA-NeXT-Video end to end (e-p-d): a ``video_url`` (an mp4 made here) through the fleet
equals in-process ``generate()`` on the same sampled frames at temperature 0; an image part is
a 400 (this family is served for video only)."""

from __future__ import annotations

import base64

import openai
import pytest

from shared.media.video import VideoLimits, decode_video
from shared.models.reference import reference_generate
from shared.settings import Settings
from tests import procs
from tests.conftest import CACHE_DIR
from tests.media import samples

MAX_TOKENS = 10
QUESTION = "What happens in the video?"


@pytest.fixture(scope="module")
def model_path():
    from shared.models.llava_next_video_tiny import ensure_tiny_llava_next_video

    return ensure_tiny_llava_next_video(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def client(kafka_bootstrap, redis_url, model_path, tmp_path_factory):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_path),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": "nextvideo"}
    with procs.fleet(env, tmp_path_factory.mktemp("next-video-fleet-logs")) as (base, _proc):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, parts, **kw):
    return client.chat.completions.create(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], **kw)


@pytest.mark.parametrize("num_frames", [None, 3])
def test_video_matches_reference_generate(client, model_path, num_frames):
    from transformers import AutoTokenizer

    s = Settings()
    raw = samples.video(samples.video_frames(16, size=(96, 64), seed=5), fps=8)
    frames = decode_video(raw, num_frames=num_frames or s.video_num_frames, fps=0, param="p",
                          limits=VideoLimits(s.max_video_duration_s, s.max_video_frames, s.max_video_side,
                                             s.max_video_decoded_frames))
    ids = reference_generate(model_path, [{"role": "user", "content": [{"type": "video"},
                                                                      {"type": "text", "text": QUESTION}]}],
                             [], MAX_TOKENS, videos=[frames])
    expected = AutoTokenizer.from_pretrained(model_path).decode(ids, skip_special_tokens=True)
    video_url = {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}
    if num_frames:
        video_url["num_frames"] = num_frames
    part = {"type": "video_url", "video_url": video_url}
    assert ask(client, [part]).choices[0].message.content == expected
    assert "".join(c.choices[0].delta.content or "" for c in ask(client, [part], stream=True) if c.choices) == expected


def test_image_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])
    assert "does not accept image input" in str(info.value) and "it accepts text, video" in str(info.value)
