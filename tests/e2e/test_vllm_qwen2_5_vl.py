"""Qwen2.5-VL through vLLM fleets, e-p-d (the KV moved engine to engine) and epd: images, a
video (its time positions stepped by the clip's own sampled fps, ``second_per_grid_ts``) and an
image beside a video give, at temperature 0, vLLM's own offline ``LLM.generate`` text on the raw
media, whole and streamed; a request without sampling fields gets the tokens and length vLLM
gives with the model's generation config (tests/e2e/vllm_checks.py). One fleet per mode, every
case against it; the Qwen2-VL cases ride on test_modes.py's vLLM fleets."""

from __future__ import annotations

import importlib.util

import numpy as np
import openai
import pytest
from PIL import Image

from tests import procs
from tests.conftest import CACHE_DIR
from tests.e2e.vllm_checks import Expected, clip, tuned_copy
from tests.vllm_offline import Case

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")

MAX_TOKENS = 10
QUESTION = "What do you see?"


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    from shared.models.qwen2_5_vl_tiny import ensure_tiny_qwen2_5_vl

    tuned = tuned_copy(ensure_tiny_qwen2_5_vl(CACHE_DIR / "models"), tmp_path_factory.mktemp("tuned") / "qwen2.5-vl")
    imgs = [_image(30, (90, 60)), _image(31, (60, 130))]
    raw, video = clip()
    step = (video.frames, video.sampled_fps)
    expected = Expected(tuned, {
        "one image": (Case(QUESTION, imgs[:1], max_tokens=MAX_TOKENS), []),
        "two images": (Case(QUESTION, imgs, max_tokens=MAX_TOKENS), []),
        "video": (Case(QUESTION, videos=[step], max_tokens=MAX_TOKENS), [raw]),
        "image and video": (Case(QUESTION, imgs[1:], videos=[step], max_tokens=MAX_TOKENS), [raw]),
    }, tmp_path_factory.mktemp("vllm-offline"))  # runs while the first fleet starts
    yield expected
    expected.close()


@pytest.mark.parametrize("mode", ["e-p-d", "epd"])
def test_fleet_equals_vllm_offline(mode, expected, kafka_bootstrap, redis_url, tmp_path_factory):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_ENGINE": "vllm",
           "MMFLEET_MODEL_PATH": str(expected.model_dir), "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
           "MMFLEET_REDIS_PREFIX": f"q25-vllm-{mode}"}
    with procs.fleet(env, tmp_path_factory.mktemp(f"q25-vllm-{mode}-logs"), mode=mode, ready_timeout_s=300) as (
            base, _proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        expected.check_fleet(client, f"qwen2.5-vl/{mode}")
