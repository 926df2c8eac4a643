"""Batched prefill (shared.engines.batched_prefill, shared.process.compute.LaneBatcher): prompts of
different lengths, with and without images, prefilled in one forward give what one prompt per
forward gives (logits, KV, M-RoPE offset, greedy tokens through the engine); a bad prompt fails
alone; prompts that continue a cached prefix run alone; prompts that arrive while the lane is
busy share one call, a lone one starts at once."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from shared import protocol
from shared.engines.base import MediaEmbeds
from shared.engines.batched_prefill import PAD_WASTE, _groups, prefill_many
from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.engines.transformers_engine import TransformersEngine
from shared.models.llava_tiny import ensure_tiny_llava
from shared.models.reference import load_reference, reference_generate
from shared.process.compute import ComputeLane, LaneBatcher
from tests.conftest import CACHE_DIR
from tests.unit.test_engine_llava import image, msgs
from tests.unit.test_engine_qwen2_vl import make_images, messages_for


@pytest.fixture(scope="module")
def compute(model_dir):
    return Qwen2VLCompute(model_dir)


def _prompt(compute, messages, images) -> tuple[list[int], list[MediaEmbeds]]:
    items = []
    for img in images:
        px = compute.preprocess_image(img)
        items.append(MediaEmbeds(compute.encode_media([px])[0], px.grid_thw))
    return compute.render_prompt_ids(messages), items


def _same(got, want) -> None:
    assert got.prompt_len == want.prompt_len and got.rope_delta == want.rope_delta
    assert got.kv.shape == want.kv.shape
    torch.testing.assert_close(got.kv, want.kv, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.last_logits, want.last_logits, atol=1e-4, rtol=1e-4)
    assert int(got.last_logits.argmax()) == int(want.last_logits.argmax())


def test_groups_bound_the_padding():
    lens = [100, 30, 98, 31, 400, 95, 29]
    groups = _groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert len(g) * max(lens[i] for i in g) <= (1 + PAD_WASTE) * sum(lens[i] for i in g)
    assert sorted(sorted(g) for g in groups) == [[0, 2, 5], [1, 3, 6], [4]]


def test_batched_prefill_equals_one_at_a_time(compute):
    imgs = make_images()
    prompts = [_prompt(compute, messages_for(1), [imgs["noise1"]]),
               _prompt(compute, messages_for(1, "Which colour is it, and why?"), [imgs["red"]]),
               _prompt(compute, messages_for(0, "Tell me a story."), []),
               _prompt(compute, messages_for(1, "Describe."), [imgs["vgrad"]])]
    alone = [compute.prefill(ids, media) for ids, media in prompts]
    assert len({r.prompt_len for r in alone}) > 1 and len({r.rope_delta for r in alone}) > 1
    calls = []
    real = compute.model.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["inputs_embeds"].shape[0])
        return real(*args, **kwargs)

    compute.model.forward = counted
    try:
        batched = prefill_many(compute, [(ids, media, None) for ids, media in prompts])
    finally:
        del compute.model.forward
    assert max(calls) > 1, f"no forward prefilled several prompts: {calls}"
    for got, want in zip(batched, alone, strict=True):
        _same(got, want)


def test_batched_audio_prefill_equals_one_at_a_time():
    """Qwen2-Audio's forward ignores ``logits_to_keep`` (logits of every position come back):
    each prompt's logits must still be its own last position's."""
    from shared.engines.qwen2_audio import Qwen2AudioCompute
    from shared.models.qwen2_audio_tiny import ensure_tiny_qwen2_audio
    from tests.unit.test_engine_qwen2_audio import clip
    from tests.unit.test_engine_qwen2_audio import msgs as audio_msgs

    compute = Qwen2AudioCompute(ensure_tiny_qwen2_audio(CACHE_DIR / "models"))
    prompts = []
    for freq, seconds, text in ((440.0, 0.5, "What is this sound?"), (900.0, 0.6, "Describe it."),
                                (1500.0, 0.5, "Which note?")):
        px = compute.preprocess_audio(clip(freq, seconds))
        items = [MediaEmbeds(compute.encode_media([px])[0], px.grid_thw, "audio")]
        prompts.append((compute.render_prompt_ids(audio_msgs(1, text)), items))
    alone = [compute.prefill(ids, items) for ids, items in prompts]
    batched = prefill_many(compute, [(ids, items, None) for ids, items in prompts])
    for got, want in zip(batched, alone, strict=True):
        _same(got, want)


def test_a_bad_prompt_fails_alone_and_prefix_hits_run_alone(compute):
    imgs = make_images()
    good = _prompt(compute, messages_for(1), [imgs["noise1"]])
    other = _prompt(compute, messages_for(1, "Which colour?"), [imgs["red"]])
    bad = (good[0], [])  # a placeholder with no image
    full = compute.prefill(*other)
    prefix = full.kv[:, :, :, :full.prompt_len - 3].contiguous()
    out = prefill_many(compute, [(*good, None), (*bad, None), (*other, prefix), (*other, None)])
    assert isinstance(out[1], ValueError)
    _same(out[0], compute.prefill(*good))
    _same(out[2], full)  # the prefix hit: its last 3 positions computed over the cached ones
    _same(out[3], full)


async def test_lane_batcher_batches_what_arrives_while_busy():
    lane = ComputeLane("test")
    seen: list[list[int]] = []
    gate = threading.Event()

    def fn(items):
        seen.append(list(items))
        return [ValueError(i) if i == 3 else i * 10 for i in items]

    batcher = LaneBatcher(fn, lane, max_items=3)
    try:
        assert await batcher.submit(7) == 70  # alone: runs at once
        busy = asyncio.ensure_future(lane.run(gate.wait))
        calls = [asyncio.ensure_future(batcher.submit(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        await busy
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert results[:3] == [0, 10, 20] and results[4] == 40
        assert isinstance(results[3], ValueError)  # that item's own error, its batch-mates fine
        assert seen == [[7], [0, 1, 2], [3, 4]]  # at most max_items per call, in arrival order
        assert (batcher.batches, batcher.items) == (3, 6)
    finally:
        lane.close()


async def _generate_together(engine, compute, requests) -> list[list[int]]:
    """Encode every request's images, then hold the lane while all prefills arrive."""
    prompts = []
    for messages, images in requests:
        items = []
        for img in images:
            px = compute.preprocess_image(img)
            items.append(MediaEmbeds(await engine.encode(px.pixel_values, px.grid_thw, px.n_tokens), px.grid_thw))
        prompts.append((compute.render_prompt_ids(messages), items))

    async def one(i, ids, items):
        sampling = protocol.Sampling(max_tokens=8, temperature=0.0)
        return [t async for t in engine.generate(f"r{i}", ids, items, sampling)]

    gate = threading.Event()
    busy = asyncio.ensure_future(engine._lane.run(gate.wait))
    runs = asyncio.gather(*(one(i, ids, items) for i, (ids, items) in enumerate(prompts)))
    await asyncio.sleep(0.05)
    gate.set()
    await busy
    return await runs


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
async def test_engine_prefills_concurrent_requests_together(model_dir, family):
    if family == "llava":
        model_dir = ensure_tiny_llava(CACHE_DIR / "models")
        requests = [(msgs(1), [image(1)]), (msgs(1, "Compare it."), [image(2)]), (msgs(1), [image(4)])]
    else:
        imgs = make_images()
        requests = [(messages_for(1), [imgs["noise1"]]), (messages_for(1, "Which colour?"), [imgs["red"]]),
                    (messages_for(0, "Tell me a story."), []), (messages_for(1), [imgs["hgrad"]])]
    reference = load_reference(model_dir)
    expected = [reference_generate(model_dir, m, imgs_, 8, loaded=reference) for m, imgs_ in requests]
    engine = TransformersEngine(model_dir)
    await engine.start()
    try:
        got = await _generate_together(engine, engine.compute, requests)
        batches, prompts = engine.prefill_stats
        assert got == expected
        assert prompts == len(requests) and batches < prompts, "no prefill ran batched with another"
    finally:
        await engine.stop()
