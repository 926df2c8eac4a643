"""Precomputed embeddings' decoder: .npy (no pickle), safetensors and torch.save (weights_only,
after the zip directory's bounds) read header first; every bad or hostile payload a 400 naming
the part, never another exception; a property test over arbitrary and mutated payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.media.embeds import parse_embeddings, parse_ints, sniff
from shared.media.sources import MediaError
from tests.media.embeds_blobs import (
    callable_pickle_blob,
    lying_zip_blob,
    npy,
    safetensors_bytes,
    torch_blob,
    zip_bomb_blob,
)

HIDDEN = 128


def parse(raw: bytes, fmt: str | None = None, *, allow_torch: bool = True, max_rows: int = 16):
    return parse_embeddings(raw, fmt=fmt or sniff(raw), hidden_size=HIDDEN, max_rows=max_rows, param="p",
                            allow_torch=allow_torch, max_bytes=1 << 20)


def test_every_format_reads_the_same_values():
    arr = np.random.default_rng(0).standard_normal((4, HIDDEN)).astype(np.float32)
    exact = [npy(arr), npy(arr.astype(">f4")), npy(np.asfortranarray(arr)), safetensors_bytes(x=arr),
             torch_blob(torch.from_numpy(arr)), torch_blob(torch.from_numpy(arr)[:, :])]
    for raw in exact:
        out = parse(raw)
        assert out.dtype == np.float32 and out.flags.writeable and np.array_equal(out, arr), sniff(raw)
    from safetensors.torch import save

    narrow = [npy(arr.astype(np.float16)), safetensors_bytes(x=arr.astype(np.float16)),
              save({"x": torch.from_numpy(arr).to(torch.bfloat16)}), torch_blob(torch.from_numpy(arr).bfloat16())]
    for raw in narrow:
        assert np.allclose(parse(raw), arr, atol=2e-2), sniff(raw)


def test_grids_as_tensors():
    as_torch = torch_blob(torch.tensor([1, 4, 6]))
    assert parse_ints(as_torch, fmt="torch", size=3, param="g", allow_torch=True) == (1, 4, 6)
    as_npy = npy(np.array([[1, 2, 2]], np.int64))
    assert parse_ints(as_npy, fmt="npy", size=3, param="g", allow_torch=False) == (1, 2, 2)
    with pytest.raises(MediaError, match="must hold 3 integers"):
        parse_ints(npy(np.array([1, 2], np.int64)), fmt="npy", size=3, param="g", allow_torch=False)


@pytest.mark.parametrize("raw, fragment", [
    (npy(np.zeros((4, 64), np.float32)), "its hidden size is 128"),
    (npy(np.zeros((2, 2, HIDDEN), np.float32)), "needs [n_tokens, 128]"),
    (npy(np.zeros((4, HIDDEN), np.int32)), "floating point"),
    (npy(np.zeros((4, HIDDEN), np.float64)), "got dtype float64"),
    (npy(np.array([{"a": 1}], dtype=object)), "without pickle"),
    (npy(np.full((2, HIDDEN), np.nan, np.float32)), "NaN"),
    (npy(np.zeros((0, HIDDEN), np.float32)), "send between 1 and 16"),
    (npy(np.zeros((17, HIDDEN), np.float32)), "17 rows"),
    (npy(np.zeros((4, HIDDEN), np.float32))[:-8], "holds 2040"),  # truncated data
    (b"\x93NUMPY garbage", "corrupt"),
    (b"not any format at all", "match none of them"),
    (safetensors_bytes(a=np.zeros((2, HIDDEN), np.float32), b=np.zeros((2, HIDDEN), np.float32)),
     "exactly one tensor"),
    (safetensors_bytes(a=np.zeros((2, HIDDEN), np.float32))[:-4], "do not hold shape"),
    (b"\xff\xff\xff\xff\xff\xff\xff\x00{", "a header of"),
    (struct.pack("<Q", 60_007) + b'{"a": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "its header is not JSON"),
    (npy(np.zeros((2, HIDDEN), np.float32)).replace(b"{", b"v", 1), "the .npy file is corrupt"),
    (torch_blob(torch.zeros(4, HIDDEN, dtype=torch.float64)), "got dtype float64"),
    (torch_blob(torch.zeros(4, 64)), "its hidden size is 128"),
    (torch_blob(torch.zeros(4, HIDDEN).to_sparse()), "dense"),
    (torch_blob({"x": torch.zeros(4, HIDDEN)}), "one plain tensor"),
    (torch_blob(torch.zeros(4, HIDDEN), _use_new_zipfile_serialization=False), "match none of them"),
    (callable_pickle_blob(), "unsupported GLOBAL posix.system"),
    (zip_bomb_blob(), "'archive/data/0' is compressed"),
    (lying_zip_blob(), "declares 2147483648 bytes beyond the payload"),
])
def test_bad_and_hostile_payloads_are_400s(raw, fragment):
    with pytest.raises(MediaError) as info:
        parse(raw)
    assert info.value.status == 400 and fragment in str(info.value) and str(info.value).startswith("p: "), \
        str(info.value)


def test_a_header_is_judged_before_its_data_is_read():
    """A header declaring 10^12 rows is refused by its rows, not by trying to hold them."""
    huge = npy(np.zeros((1, HIDDEN), np.float32)).replace(b"(1, 128)", b"(1000000000000, 128)", 1)
    with pytest.raises(MediaError, match="1000000000000 rows"):
        parse(huge)
    import json

    header = json.dumps({"x": {"dtype": "F32", "shape": [10**12, HIDDEN], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(MediaError, match="1000000000000 rows"):
        parse(struct.pack("<Q", len(header)) + header + bytes(4))


def test_torch_refused_by_name_where_off():
    with pytest.raises(MediaError, match="send the tensor as npy or safetensors"):
        parse(torch_blob(torch.zeros(4, HIDDEN)), allow_torch=False)
    with pytest.raises(MediaError, match="format must be one of npy, safetensors$"):
        parse(npy(np.zeros((4, HIDDEN), np.float32)), fmt="pt", allow_torch=False)


_VALID = [npy(np.ones((3, HIDDEN), np.float32)), safetensors_bytes(x=np.ones((3, HIDDEN), np.float16)),
          torch_blob(torch.ones(3, HIDDEN))]


@st.composite
def payloads(draw):
    """Arbitrary bytes behind each format's magic, or a valid payload with bytes overwritten."""
    if draw(st.booleans()):
        return draw(st.sampled_from([b"\x93NUMPY", b"PK\x03\x04", b"\x10\x00\x00\x00\x00\x00\x00\x00{", b""])) \
            + draw(st.binary(max_size=512))
    raw = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(raw) - 1))
        raw[at] = draw(st.integers(0, 255))
    return bytes(raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads())
def test_property_any_payload_is_a_checked_array_or_a_400(raw):
    try:
        out = parse(raw)
    except MediaError as exc:
        assert exc.status == 400 and str(exc).startswith("p: ")
        return
    assert out.dtype == np.float32 and out.ndim == 2 and out.shape[1] == HIDDEN and 1 <= out.shape[0] <= 16
    assert np.isfinite(out).all()
