"""LLaVA end to end: the tiny offline LLaVA served by ``mmfleet up`` (e-p-d), driven by the
official ``openai`` client; at temperature 0 the fleet's text equals in-process ``generate()``
for the same images, and modalities LLaVA does not take are a 400 naming them."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from shared.models.reference import reference_generate
from tests import procs
from tests.conftest import CACHE_DIR

MAX_TOKENS = 10
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def llava_dir():
    from shared.models.llava_tiny import ensure_tiny_llava

    return ensure_tiny_llava(CACHE_DIR / "models")


@pytest.fixture(scope="module")
def client(kafka_bootstrap, redis_url, llava_dir, tmp_path_factory):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(llava_dir),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": "llava"}
    with procs.fleet(env, tmp_path_factory.mktemp("llava-fleet-logs")) as (base, _proc):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def image(seed: int, size=(90, 60)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def expected_text(llava_dir, imgs) -> str:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [*({"type": "image"} for _ in imgs), {"type": "text", "text": QUESTION}]}]
    ids = reference_generate(llava_dir, messages, imgs, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(llava_dir).decode(ids, skip_special_tokens=True)


def ask(client, parts, **kw):
    return client.chat.completions.create(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], **kw)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_matches_reference_generate(client, llava_dir, n):
    imgs = [image(20 + i, size=(70 + 40 * i, 50)) for i in range(n)]
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in imgs]
    expected = expected_text(llava_dir, imgs)
    assert ask(client, parts).choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, parts, stream=True) if c.choices)
    assert streamed == expected


@pytest.mark.parametrize("part, modality", [
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "video"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
])
def test_other_modalities_are_400(client, part, modality):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, [part])
    assert f"does not accept {modality} input" in str(info.value) and "it accepts text, image" in str(info.value)
