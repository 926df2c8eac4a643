"""VllmEngine serving Qwen2.5-VL from image embeddings (the encode stage's output, here the
transformers encoder with its window attention) equals one-process ``generate()``. One engine
for the module; the Qwen2-VL engine tests (test_vllm_engine.py) cover the rest of the adapter."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from PIL import Image  # noqa: E402

from shared import protocol  # noqa: E402
from shared.engines.qwen2_5_vl import Qwen2_5_VLCompute  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.models.qwen2_5_vl_tiny import ensure_tiny_qwen2_5_vl  # noqa: E402
from shared.models.reference import load_reference, reference_generate  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402

MAX_NEW_TOKENS = 12
IMAGES = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (h, w, 3), dtype=np.uint8))
          for s, (w, h) in enumerate([(120, 90), (200, 150)])]


@pytest.fixture(scope="module")
def q25_dir():
    return ensure_tiny_qwen2_5_vl(CACHE_DIR / "models")


@pytest.fixture(scope="module")
async def engine(q25_dir):
    eng = VllmEngine(q25_dir, kv_cache_bytes=256 << 20)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.mark.parametrize("n", [0, 1, 2], ids=["text", "one_image", "two_images"])
async def test_greedy_matches_generate(engine, q25_dir, n):
    compute, reference = Qwen2_5_VLCompute(q25_dir), load_reference(q25_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": "What?"}]}]
    expected = reference_generate(q25_dir, msgs, IMAGES[:n], MAX_NEW_TOKENS, loaded=reference)
    pixels = [compute.preprocess_image(im) for im in IMAGES[:n]]
    items = [(f, p.grid_thw) for f, p in zip(compute.encode_media(pixels), pixels)]
    got = [t async for t in engine.generate(f"q25-{n}", compute.render_prompt_ids(msgs), items,
                                            protocol.Sampling(max_tokens=MAX_NEW_TOKENS, temperature=0.0))]
    assert got == expected and len(set(got)) > 1
