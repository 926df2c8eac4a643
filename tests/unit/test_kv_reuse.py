"""Prefix reuse on the real (tiny) Qwen2-VL: the same prompt gives the same first token, KV and
greedy continuation whether its prefix KV is computed or taken from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared import protocol
from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.kv.prefix_cache import PrefixCache
from shared.kv.reuse import PrefixReuse

BLOCK = 8


@pytest.fixture(scope="module")
def compute(model_dir):
    return Qwen2VLCompute(model_dir)


def greedy(compute: Qwen2VLCompute, result, n: int = 10) -> list[int]:
    state = compute.start_decode(result.kv, result.rope_delta, result.prompt_len)
    tokens = [int(result.last_logits.argmax())]
    while len(tokens) < n and tokens[-1] not in compute.eos_token_ids:
        tokens.append(int(compute.decode_step(state, tokens[-1]).argmax()))
    return tokens


def request(compute: Qwen2VLCompute, img: Image.Image, turns: list[str], mm_hash: str):
    px = compute.preprocess_image(img)
    emb = compute.encode_media([px])[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": turns[0]}]}]
    for t in turns[1:]:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": t}]
    ids = compute.render_prompt_ids(messages)
    ref = protocol.TensorRef(agent="a", addr=0, nbytes=0, device_id=0, lease=0, dtype="float32", shape=())
    meta = protocol.RequestMeta(request_id="r", model="m", deadline_unix_ms=0, created_unix_ms=0,
                                prompt_token_ids=tuple(ids))
    msg = protocol.PrefillRequest(meta=meta, items=(protocol.EmbeddingItem(0, mm_hash, px.grid_thw, px.n_tokens,
                                                                           ref),))
    return msg, ids, [(emb, px.grid_thw)]


def test_reused_prefix_gives_the_same_output(compute):
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    reuse = PrefixReuse(PrefixCache(1 << 24, BLOCK), compute.placeholder_token_id)
    turn1, ids1, images = request(compute, img, ["What is in the image?"], "h1")
    full1 = compute.prefill(ids1, images)
    look = reuse.lookup(turn1, full1.prompt_len)
    assert look.prefix_kv is None
    assert reuse.keep(look, full1.kv).stored  # the blocks stored: for the routing table

    # the same prompt again: all whole blocks hit, at least one position is computed
    look = reuse.lookup(turn1, full1.prompt_len)
    assert 0 < look.prefix_len < full1.prompt_len
    again = compute.prefill(ids1, images, prefix_kv=look.prefix_kv)
    assert greedy(compute, again) == greedy(compute, full1)
    assert torch.allclose(again.kv, full1.kv, atol=1e-4) and again.rope_delta == full1.rope_delta

    # a follow-up turn: the first turn's blocks are its prefix
    turn2, ids2, images = request(compute, img, ["What is in the image?", "And the colours?"], "h1")
    full2 = compute.prefill(ids2, images)
    look = reuse.lookup(turn2, full2.prompt_len)
    assert look.prefix_len >= (full1.prompt_len // BLOCK - 1) * BLOCK > 0
    reused = compute.prefill(ids2, images, prefix_kv=look.prefix_kv)
    assert greedy(compute, reused) == greedy(compute, full2)
    assert torch.allclose(reused.kv, full2.kv, atol=1e-4)


def test_another_image_behind_the_same_tokens_reuses_nothing_past_the_text(compute):
    reuse = PrefixReuse(PrefixCache(1 << 24, BLOCK), compute.placeholder_token_id)
    red, blue = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 255))
    msg_r, ids, images_r = request(compute, red, ["Which colour?"], "red")
    reuse.keep(reuse.lookup(msg_r, len(ids)), compute.prefill(ids, images_r).kv)
    msg_b, _ids, _images_b = request(compute, blue, ["Which colour?"], "blue")
    image_start = list(msg_b.meta.prompt_token_ids).index(compute.placeholder_token_id)
    look = reuse.lookup(msg_b, 10_000)
    assert look.prefix_len <= image_start, "no block holding the image is shared"
