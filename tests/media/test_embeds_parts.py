"""Embeddings content parts at the gateway: vLLM's string and dict forms and mmfleet's, for image,
video and audio; the family's grid and time-step rules; every refusal a 4xx naming the part."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.gateway import schema
from services.gateway.embeds_parts import EmbedsRules, read_part
from services.gateway.prompt import PromptBuilder
from shared.settings import Settings
from shared.stage import RequestFailed
from tests.media.embeds_blobs import b64, callable_pickle_blob, npy, torch_blob

HIDDEN = 128
P0 = "messages[0].content[0]"


@pytest.fixture(scope="module")
def builder(model_dir):
    return PromptBuilder.for_model(model_dir, Settings())


def chat(builder, *parts, role="user"):
    body = json.dumps({"model": "mmfleet-demo", "messages": [{"role": role, "content": list(parts)}]}).encode()
    return builder.chat(schema.parse_chat(body))


def refused(builder, part, fragment, status=400):
    with pytest.raises(RequestFailed) as info:
        chat(builder, part)
    ev = info.value.event
    assert ev.status == status and fragment in ev.message and ev.param == P0, ev.message


def decoded(item) -> np.ndarray:
    import io

    return np.load(io.BytesIO(item.data), allow_pickle=False)


def test_vllm_and_mmfleet_forms_become_the_same_item(builder):
    arr = np.random.default_rng(1).standard_normal((4, HIDDEN)).astype(np.float32)
    forms = [
        {"type": "image_embeds", "image_embeds": {"data": b64(npy(arr)), "format": "npy", "grid_thw": [1, 4, 4]}},
        {"type": "image_embeds", "image_embeds": {"image_embeds": b64(torch_blob(torch.from_numpy(arr))),
                                                  "image_grid_thw": b64(torch_blob(torch.tensor([[1, 4, 4]])))}},
        {"type": "image_embeds", "image_embeds": {"image_embeds": b64(npy(arr)), "image_grid_thw": [1, 4, 4]},
         "uuid": "accepted-no-effect"},
    ]
    items = [chat(builder, f).media[0] for f in forms]
    for item in items:
        assert (item.kind, item.mime, item.grid_thw, item.rows) == ("image_embeds", "npy", (1, 4, 4), 4)
        assert np.array_equal(decoded(item), arr)
    video = chat(builder, {"type": "video_embeds", "video_embeds": {
        "video_embeds": b64(torch_blob(torch.from_numpy(arr).repeat(2, 1))), "video_grid_thw": [[2, 4, 4]]}})
    (item,) = video.media
    assert (item.kind, item.grid_thw, item.rows, item.second_per_grid_t) == ("video_embeds", (2, 4, 4), 8, 0.0)


def test_refusals_name_the_part(builder):
    ok = npy(np.ones((4, HIDDEN), np.float32))
    own = {"data": b64(ok), "grid_thw": [1, 4, 4]}
    for bad, fragment in [
        ({"type": "image_embeds", "image_embeds": b64(ok)}, "needs the patch grid"),  # vLLM's string: no grid
        ({"type": "image_embeds", "image_embeds": {**own, "grid_thw": [1, 3, 4]}}, "multiples of 2"),
        ({"type": "image_embeds", "image_embeds": {**own, "data": b64(npy(np.ones((3, HIDDEN), np.float32)))}},
         "3 rows; grid_thw [1, 4, 4] needs 4"),
        ({"type": "image_embeds", "image_embeds": {**own, "data": b64(npy(np.ones((4, 96), np.float32)))}},
         "its hidden size is 128"),
        ({"type": "image_embeds", "image_embeds": {**own, "image_embeds": b64(ok)}}, "not both"),
        ({"type": "image_embeds", "image_embeds": {"grid_thw": [1, 4, 4]}}, "none was given"),
        ({"type": "image_embeds", "image_embeds": {**own, "image_grid_thw": [1, 4, 4]}},
         "give grid_thw or image_grid_thw"),
        ({"type": "image_embeds", "image_embeds": {**own, "data": "not base64!"}}, "not valid base64"),
        ({"type": "image_embeds", "image_embeds": {"image_embeds": b64(callable_pickle_blob()),
                                                   "image_grid_thw": [1, 4, 4]}}, "weights_only"),
        ({"type": "image_embeds", "image_embeds": {**own, "image_grid_thw": None, "grid_thw": [1, 4]}},
         "must be 3 integers"),
        ({"type": "video_embeds", "video_embeds": {"data": b64(ok), "grid_thw": [1, 4, 4],
                                                   "second_per_grid_ts": [1.0]}}, "do not use a time step"),
    ]:
        refused(builder, bad, fragment)
    refused(builder, {"type": "audio_embeds", "audio_embeds": b64(ok)}, "does not accept audio input")


def test_the_payload_bound_is_checked_on_base64(model_dir):
    small = PromptBuilder.for_model(model_dir, Settings(max_embeds_bytes=1024))
    big = {"type": "image_embeds", "image_embeds": {"data": b64(npy(np.ones((4, HIDDEN), np.float32))),
                                                    "grid_thw": [1, 4, 4]}}
    refused(small, big, "above the 1368 that max_embeds_bytes (1024 bytes) allows", status=413)
    off = PromptBuilder.for_model(model_dir, Settings(embeds_torch_load=False))
    refused(off, {"type": "image_embeds", "image_embeds": {
        "image_embeds": b64(torch_blob(torch.ones(4, HIDDEN))), "image_grid_thw": [1, 4, 4]}}, "npy or safetensors")


AUDIO = EmbedsRules(hidden_size=HIDDEN, max_rows=64, max_bytes=1 << 20, allow_torch=True)
QWEN25 = EmbedsRules(hidden_size=HIDDEN, max_rows=64, max_bytes=1 << 20, allow_torch=True, merge_size=2,
                     video_time_step=True)


def part_of(obj: dict):
    return schema.parse_chat(json.dumps({"model": "m", "messages": [{"role": "user", "content": [obj]}]})
                             ).messages[0].content[0]


def test_audio_and_time_step_rules():
    arr = np.ones((5, HIDDEN), np.float32)
    got = read_part(part_of({"type": "audio_embeds", "audio_embeds": b64(torch_blob(torch.from_numpy(arr)))}),
                    P0, AUDIO)
    assert (got.kind, got.rows, got.grid_thw) == ("audio_embeds", 5, (0, 0, 0))
    ok = read_part(part_of({"type": "audio_embeds", "audio_embeds": {"audio_embeds": b64(npy(arr)),
                                                                     "audio_num_tokens": [5]}}), P0, AUDIO)
    assert ok.rows == 5
    video = {"video_embeds": b64(npy(np.ones((8, HIDDEN), np.float32))), "video_grid_thw": [2, 4, 4]}
    step = read_part(part_of({"type": "video_embeds", "video_embeds": {
        **video, "second_per_grid_ts": b64(torch_blob(torch.tensor([0.5])))}}), P0, QWEN25)
    assert step.second_per_grid_t == 0.5
    for bad, rules, fragment in [
        ({"type": "audio_embeds", "audio_embeds": {"audio_embeds": b64(npy(arr)), "audio_num_tokens": [4]}},
         AUDIO, "audio_num_tokens: 4, but the embeddings have 5 rows"),
        ({"type": "video_embeds", "video_embeds": video}, QWEN25, "need second_per_grid_ts"),
        ({"type": "video_embeds", "video_embeds": {**video, "second_per_grid_ts": [-1.0]}}, QWEN25,
         "one positive number"),
        ({"type": "image_embeds", "image_embeds": {"data": b64(npy(arr)), "grid_thw": [1, 2, 2]}}, AUDIO,
         "do not use a grid"),
    ]:
        with pytest.raises(RequestFailed) as info:
            read_part(part_of(bad), P0, rules)
        assert info.value.event.status == 400 and fragment in info.value.event.message, info.value.event.message
