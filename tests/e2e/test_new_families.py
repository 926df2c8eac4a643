"""Qwen2.5-VL (images, video) and LLaVA-NeXT (anyres images) end to end, as the other families:
the tiny offline build served by ``mmfleet up`` (e-p-d), driven by the official ``openai``
client; at temperature 0 the fleet's text, whole and streamed, equals in-process ``generate()``
on the same inputs. One fleet per family, every case against it."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from shared.media.video import VideoClip, VideoLimits, decode_video_clip
from shared.models.reference import reference_generate
from shared.settings import Settings
from tests import procs
from tests.conftest import CACHE_DIR
from tests.media import samples

MAX_TOKENS = 10
QUESTION = "What do you see?"
SIZES = [(90, 60), (60, 130)]  # different aspect ratios: LLaVA-NeXT tiles each its own way


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _video() -> tuple[bytes, VideoClip]:
    s = Settings()
    raw = samples.video(samples.video_frames(16, size=(96, 64), seed=5), fps=8)
    clip = decode_video_clip(raw, num_frames=s.video_num_frames, fps=0, param="p",
                             limits=VideoLimits(s.max_video_duration_s, s.max_video_frames, s.max_video_side,
                                                s.max_video_decoded_frames))
    return raw, clip


@pytest.fixture(scope="module", params=["qwen2.5-vl", "llava-next"])
def served(request, kafka_bootstrap, redis_url, tmp_path_factory):
    """(family demo name, model dir, openai client) with that family's fleet up."""
    from shared.models.registry import DEMOS

    model = DEMOS[request.param](CACHE_DIR / "models")
    prefix = request.param.replace(".", "")
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": prefix}
    with procs.fleet(env, tmp_path_factory.mktemp(f"{prefix}-fleet-logs")) as (base, _proc):
        yield request.param, model, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                                  timeout=120)


def _cases(demo: str):
    """(name, reference content parts, images, videos, request parts)"""
    imgs = [_image(30 + i, size) for i, size in enumerate(SIZES)]
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in imgs]
    out = [("one image", [{"type": "image"}], imgs[:1], [], parts[:1]),
           ("two images", [{"type": "image"}] * 2, imgs, [], parts)]
    if demo == "qwen2.5-vl":
        raw, clip = _video()
        url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
        out.append(("video", [{"type": "video"}], [], [clip], [{"type": "video_url", "video_url": {"url": url}}]))
    return out


def test_fleet_equals_generate(served):
    from transformers import AutoTokenizer

    demo, model, client = served
    tok = AutoTokenizer.from_pretrained(model)
    for name, ref_parts, images, videos, parts in _cases(demo):
        # the clip's own sampling rate in the reference too: Qwen2.5-VL's time positions step by it
        ids = reference_generate(model, [{"role": "user", "content": [*ref_parts, {"type": "text", "text": QUESTION}]}],
                                 images, MAX_TOKENS, videos=[c.frames for c in videos] or None,
                                 video_fps=[c.sampled_fps for c in videos] or None)
        expected = tok.decode(ids, skip_special_tokens=True)
        kwargs = dict(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS,
                      messages=[{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}])
        for attempt in range(2):  # the second time from the embedding cache
            assert client.chat.completions.create(**kwargs).choices[0].message.content == expected, \
                f"{demo} / {name} / attempt {attempt}"
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == expected, f"{demo} / {name} (stream)"
