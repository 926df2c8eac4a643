"""Precomputed embeddings as a content part: .npy (no pickle) and safetensors parsing, the
hidden size / rows / grid checks at the gateway, every bad input a 4xx naming the part."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from services.gateway import schema
from services.gateway.prompt import PromptBuilder
from shared.media.embeds import parse_embeddings
from shared.media.sources import MediaError
from shared.settings import Settings
from shared.stage import RequestFailed

HIDDEN = 128


def npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def safetensors_bytes(**tensors) -> bytes:
    from safetensors.numpy import save

    return save(tensors)


def test_parse_both_formats():
    arr = np.random.default_rng(0).standard_normal((4, HIDDEN)).astype(np.float32)
    for raw, fmt in ((npy(arr), "npy"), (safetensors_bytes(x=arr), "safetensors"),
                     (npy(arr.astype(np.float16)), "npy")):
        out = parse_embeddings(raw, fmt=fmt, hidden_size=HIDDEN, max_rows=16, param="p")
        assert out.dtype == np.float32 and np.allclose(out, arr, atol=1e-2)


@pytest.mark.parametrize("raw, fmt, fragment", [
    (npy(np.zeros((4, 64), np.float32)), "npy", "its hidden size is 128"),
    (npy(np.zeros((2, 2, HIDDEN), np.float32)), "npy", "needs [n_tokens, 128]"),
    (npy(np.zeros((4, HIDDEN), np.int32)), "npy", "floating point"),
    (npy(np.array([{"a": 1}], dtype=object)), "npy", "without pickle"),
    (npy(np.full((2, HIDDEN), np.nan, np.float32)), "npy", "NaN"),
    (npy(np.zeros((0, HIDDEN), np.float32)), "npy", "send between 1 and 16"),
    (npy(np.zeros((17, HIDDEN), np.float32)), "npy", "17 rows"),
    (b"PK\x03\x04 a torch.save zip", "npy", "not a .npy file"),
    (b"\x93NUMPY garbage", "npy", "corrupt"),
    (b"not safetensors", "safetensors", "not a readable safetensors file"),
    (safetensors_bytes(a=np.zeros((2, HIDDEN), np.float32), b=np.zeros((2, HIDDEN), np.float32)), "safetensors",
     "exactly one tensor"),
    (npy(np.zeros((2, HIDDEN), np.float32)), "pt", "format must be one of npy, safetensors"),
])
def test_bad_embeddings(raw, fmt, fragment):
    with pytest.raises(MediaError) as info:
        parse_embeddings(raw, fmt=fmt, hidden_size=HIDDEN, max_rows=16, param="p")
    assert info.value.status == 400 and fragment in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def builder(model_dir):
    return PromptBuilder.for_model(model_dir, Settings())


def part(arr_bytes: bytes, fmt="npy", grid=(1, 4, 4)) -> dict:
    data = {"data": base64.b64encode(arr_bytes).decode(), "format": fmt}
    if grid is not None:
        data["grid_thw"] = list(grid)
    return {"type": "image_embeds", "image_embeds": data}


def chat(builder, *parts):
    body = json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": list(parts)}]}).encode()
    return builder.chat(schema.parse_chat(body))


def test_gateway_accepts_and_checks(builder):
    ok = npy(np.ones((4, HIDDEN), np.float32))
    p = chat(builder, part(ok))
    assert [(m.kind, m.mime, m.grid_thw, m.data == ok) for m in p.media] == [("image_embeds", "npy", (1, 4, 4), True)]
    for bad, fragment in ((part(ok, grid=None), "grid_thw must be [t, h, w]"),
                          (part(ok, grid=(1, 3, 4)), "multiples of 2"),
                          (part(npy(np.ones((3, HIDDEN), np.float32))), "3 rows; grid_thw [1, 4, 4] needs 4"),
                          (part(npy(np.ones((4, 96), np.float32))), "its hidden size is 128")):
        with pytest.raises(RequestFailed) as info:
            chat(builder, bad)
        ev = info.value.event
        assert ev.status == 400 and fragment in ev.message and ev.param == "messages[0].content[0]", ev.message
