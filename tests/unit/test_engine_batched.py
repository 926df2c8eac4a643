"""Batched decode (shared.engines.batched) against one-process ``generate()``: requests that
generate at the same time, joining and leaving at different steps, with different prompt
lengths and M-RoPE offsets, each get exactly their own greedy tokens — on Qwen2-VL (M-RoPE,
rope_delta per sequence) and LLaVA (plain positions, the path Qwen2-Audio and
LLaVA-NeXT-Video share) — and the steps really ran batched, on a padded KV kept between steps
and rebuilt when the set of sequences changed."""

from __future__ import annotations

import asyncio

import pytest
import transformers.integrations.sdpa_attention as hf_sdpa

from shared import metrics, protocol
from shared.engines.base import MediaEmbeds
from shared.engines.transformers_engine import TransformersEngine
from shared.models.llava_tiny import ensure_tiny_llava
from shared.models.reference import load_reference, reference_generate
from tests.conftest import CACHE_DIR
from tests.unit.test_engine_llava import image, msgs
from tests.unit.test_engine_qwen2_vl import make_images, messages_for

MAX_NEW = 10


async def _run_concurrently(engine: TransformersEngine, requests: list[tuple[list[dict], list]]) -> list[list[int]]:
    """Each request: encode its images, then generate; request i starts i steps' worth later,
    so sequences join a running batch, and stop at different lengths (max_tokens differ). The
    first two requests each wait after their first token (prefill's) until both have it, so they
    enter decode in the same loop turn and share its first step: left to timing, a loaded
    machine let the first finish before the second came, and no step was shared."""
    compute = engine.compute
    prefilled = [asyncio.Event() for _ in requests[:2]]

    async def one(i: int, messages, images) -> list[int]:
        await asyncio.sleep(0.01 * i)
        items = []
        for img in images:
            px = compute.preprocess_image(img)
            emb = await engine.encode(px.pixel_values, px.grid_thw, px.n_tokens)
            items.append(MediaEmbeds(emb, px.grid_thw))
        sampling = protocol.Sampling(max_tokens=MAX_NEW - i % 3, temperature=0.0)
        out = []
        async for t in engine.generate(f"r{i}", compute.render_prompt_ids(messages), items, sampling):
            out.append(t)
            if len(out) == 1 and i < len(prefilled):
                prefilled[i].set()
                await asyncio.gather(*(e.wait() for e in prefilled))
        return out

    return await asyncio.gather(*(one(i, m, imgs) for i, (m, imgs) in enumerate(requests)))


async def _check(model_dir, requests, *, rebuilt: bool = False, kv_copies: list | None = None) -> None:
    """``rebuilt``: the set of sequences changed while some kept stepping (the stack was written
    back and built again at least once). ``kv_copies``: filled with transformers' per-head K / V
    copies while the requests run (there must be none: shared.engines.cpu_attention)."""
    reference = load_reference(model_dir)
    expected = [reference_generate(model_dir, m, imgs, MAX_NEW - i % 3, loaded=reference)
                for i, (m, imgs) in enumerate(requests)]
    if kv_copies is not None:
        kv_copies.clear()  # the reference's own calls above do not count
    engine = TransformersEngine(model_dir, decode_max_batch=8)
    await engine.start()
    batches = metrics.DECODE_BATCH.collect()[0]
    before = {s.name: s.value for s in batches.samples}
    try:
        got = await _run_concurrently(engine, requests)
        decoder = engine._decoder
        assert got == expected
        assert decoder.steps > decoder.forwards, "no decode step ran batched with another"
        after = {s.name: s.value for s in metrics.DECODE_BATCH.collect()[0].samples}
        assert after["mmfleet_decode_batch_sequences_count"] - before["mmfleet_decode_batch_sequences_count"] \
            == decoder.forwards  # the metric an operator reads: one sample per forward, its sequences
        assert after["mmfleet_decode_batch_sequences_sum"] - before["mmfleet_decode_batch_sequences_sum"] \
            == decoder.steps
        assert decoder.stack.reused > 0  # steps appended to the stack as it was
        assert not kv_copies, "a padded decode step copied K / V per query head (repeat_kv)"
        if rebuilt:
            assert decoder.stack.builds > 1
    finally:
        await engine.stop()


def _count_kv_copies(monkeypatch) -> list[int]:
    """transformers' per-head K / V copies from now on (both tiny LMs have 2 query heads per KV head)."""
    copies: list[int] = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda h, n: (n > 1 and copies.append(n)) or real(h, n))
    return copies


async def test_concurrent_qwen2_vl_requests_equal_generate(model_dir, monkeypatch):
    imgs = make_images()
    requests = [(messages_for(0, "Tell me a story."), []),
                (messages_for(1), [imgs["noise1"]]),
                (messages_for(2), [imgs["noise_big"], imgs["hgrad"]]),
                (messages_for(1, "Which colour?"), [imgs["red"]]),
                (messages_for(1), [imgs["vgrad"]])]
    await _check(model_dir, requests, rebuilt=True, kv_copies=_count_kv_copies(monkeypatch))


@pytest.fixture(scope="module")
def llava_dir():
    return ensure_tiny_llava(CACHE_DIR / "models")


async def test_concurrent_llava_requests_equal_generate(llava_dir, monkeypatch):
    requests = [(msgs(1), [image(1)]), (msgs(2, "Compare them."), [image(2), image(3)]), (msgs(1), [image(4)])]
    await _check(llava_dir, requests, kv_copies=_count_kv_copies(monkeypatch))
