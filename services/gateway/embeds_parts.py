"""Precomputed-embedding content parts (``image_embeds``, ``video_embeds``, ``audio_embeds``) in
vLLM's forms and mmfleet's, read into one checked float32 ``.npy`` the fleet passes on.

A part is a base64 string (vLLM: a ``torch.save`` or ``.npy`` tensor) or an object: mmfleet's
``data`` / ``format`` / ``grid_thw``, or vLLM's dict (``<modality>_embeds`` with the family's
metadata: ``*_grid_thw``, ``second_per_grid_ts``, ``audio_num_tokens``). The base64 length is
bounded before decoding, each tensor's header checked against the model (hidden size, rows, the
family's grid rules, dtype) before its data is read; every refusal is a ``RequestFailed`` naming
the part. Runs on the gateway's preparation threads. Design: docs/guide/media.md#precomputed-embeddings.
"""

from __future__ import annotations

import binascii
import io
import math
from dataclasses import dataclass

import numpy as np

from services.gateway import schema
from shared.media.embeds import FLOAT_DTYPES, parse_embeddings, parse_ints, read_array, sniff
from shared.media.sources import MediaError, strict_b64decode
from shared.stage import RequestFailed

MAX_METADATA_BYTES = 4096  # a grid or a time step as a base64 tensor: torch.save writes ~1.5 KB


@dataclass(frozen=True)
class EmbedsRules:
    """What the served model takes: ``merge_size`` > 0 means its image and video positions need
    the grid (Qwen2-VL: rows = t·h·w / merge²); ``video_time_step``: its videos need
    ``second_per_grid_ts`` (Qwen2.5-VL)."""

    hidden_size: int
    max_rows: int
    max_bytes: int
    allow_torch: bool
    merge_size: int = 0
    video_time_step: bool = False


@dataclass(frozen=True)
class EmbedsItem:
    kind: str  # "image_embeds" | "video_embeds" | "audio_embeds"
    data: bytes  # one .npy file: float32 [rows, hidden]
    rows: int
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid_t: float = 0.0


def read_part(part: schema.EmbedsPart, param: str, rules: EmbedsRules) -> EmbedsItem:
    tag = type(part).__struct_config__.tag
    modality = tag.removesuffix("_embeds")
    payload = getattr(part, tag)
    try:
        return _read(payload, tag, modality, param, rules)
    except MediaError as exc:
        raise RequestFailed(exc.status, str(exc), param=param, code=exc.code) from None


def _bad(message: str) -> MediaError:
    return MediaError(message)


def _read(payload, tag: str, modality: str, param: str, rules: EmbedsRules) -> EmbedsItem:
    at = f"{param}.{tag}"
    if isinstance(payload, str):
        b64, fmt, grid_field, meta = payload, None, None, payload
    else:
        given = [name for name in ("data", tag) if getattr(payload, name) is not None]
        if len(given) != 1:
            raise _bad(f"{at}: give the embeddings as data (mmfleet's form) or {tag} (vLLM's), "
                       + ("not both" if given else "none was given (embeddings are not kept by uuid)"))
        b64, fmt, meta = getattr(payload, given[0]), payload.format, payload
        grid_field = _grid_field(payload, modality, at)
    raw = _b64(b64, f"{at}", rules.max_bytes)
    fmt = fmt or sniff(raw)
    arr = parse_embeddings(raw, fmt=fmt, hidden_size=rules.hidden_size, max_rows=rules.max_rows, param=at,
                           allow_torch=rules.allow_torch, max_bytes=rules.max_bytes)
    rows = int(arr.shape[0])
    grid = _grid(grid_field, modality, at, rows, rules) if modality != "audio" else (0, 0, 0)
    step = _time_step(meta, at, rules) if modality == "video" else 0.0
    if modality == "audio" and not isinstance(meta, str) and meta.audio_num_tokens is not None:
        (count,) = _ints(meta.audio_num_tokens, 1, f"{at}.audio_num_tokens", rules)
        if count != rows:
            raise _bad(f"{at}.audio_num_tokens: {count}, but the embeddings have {rows} rows")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return EmbedsItem(tag, buf.getvalue(), rows, grid, step)


def _grid_field(payload, modality: str, at: str):
    """(name, value) of the grid the part sent, if any (mmfleet's ``grid_thw`` or vLLM's key)."""
    if modality == "audio":
        return None
    vllm_key = f"{modality}_grid_thw"
    sent = [(name, v) for name in ("grid_thw", vllm_key) if (v := getattr(payload, name)) is not None]
    if len(sent) > 1:
        raise _bad(f"{at}: give grid_thw or {vllm_key}, not both")
    return sent[0] if sent else None


def _grid(field, modality: str, at: str, rows: int, rules: EmbedsRules) -> tuple[int, int, int]:
    m = rules.merge_size
    if not m:
        if field is not None:
            raise _bad(f"{at}.{field[0]}: this model's {modality} positions do not use a grid (Qwen2-VL and "
                       "Qwen2.5-VL take one); send the embeddings alone")
        return 0, 0, 0
    if field is None:
        raise _bad(f"{at}: this model needs the patch grid the embeddings were encoded with: grid_thw [t, h, w] "
                   f"(or vLLM's {modality}_grid_thw)")
    name, value = field
    g = _ints(value, 3, f"{at}.{name}", rules)
    if min(g) < 1 or g[1] % m or g[2] % m:
        raise _bad(f"{at}.{name} must be [t, h, w] (positive, h and w multiples of {m}): the patch grid the "
                   f"embeddings were encoded with; got {list(g)}")
    needed = g[0] * g[1] * g[2] // m**2
    if rows != needed:
        raise _bad(f"{at}: embeddings have {rows} rows; {name} {list(g)} needs {needed}")
    return g[0], g[1], g[2]


def _time_step(meta, at: str, rules: EmbedsRules) -> float:
    value = None if isinstance(meta, str) else meta.second_per_grid_ts
    if not rules.video_time_step:
        if value is not None:
            raise _bad(f"{at}.second_per_grid_ts: this model's video positions do not use a time step "
                       "(Qwen2.5-VL's do)")
        return 0.0
    if value is None:
        raise _bad(f"{at}: this model's video positions need second_per_grid_ts (the seconds one temporal patch "
                   "spans: the processor's temporal_patch_size / fps)")
    if isinstance(value, str):
        raw = _b64(value, f"{at}.second_per_grid_ts", MAX_METADATA_BYTES, "a metadata tensor's bound")
        arr = read_array(raw, fmt=sniff(raw), param=f"{at}.second_per_grid_ts", allow_torch=rules.allow_torch,
                         max_bytes=len(raw), check=_one_float)
        value = [float(np.asarray(arr, dtype=np.float64).reshape(-1)[0])]
    if len(value) != 1 or not math.isfinite(value[0]) or not 0 < value[0] <= 3600:
        raise _bad(f"{at}.second_per_grid_ts must be one positive number of seconds; got {value}")
    return float(value[0])


def _one_float(shape: tuple[int, ...], dtype: str) -> str | None:
    if dtype not in FLOAT_DTYPES | {"float64"}:
        return f"must be a float tensor, got dtype {dtype}"
    return None if tuple(shape) in ((), (1,)) else f"must hold one number, got shape {tuple(shape)}"


def _ints(value, size: int, at: str, rules: EmbedsRules) -> tuple[int, ...]:
    """``size`` integers sent as a JSON list (flat, or one nested row as vLLM batches them) or as
    a base64 tensor."""
    if isinstance(value, str):
        raw = _b64(value, at, MAX_METADATA_BYTES, "a metadata tensor's bound")
        return parse_ints(raw, fmt=sniff(raw), size=size, param=at, allow_torch=rules.allow_torch)
    flat = value[0] if len(value) == 1 and isinstance(value[0], list) else value
    if len(flat) != size or not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        raise _bad(f"{at} must be {size} integers; got {value}")
    return tuple(flat)


def _b64(text: str, at: str, max_bytes: int, bound: str = "max_embeds_bytes") -> bytes:
    """Decoded base64, its length checked before any byte is decoded."""
    limit = 4 * -(-max_bytes // 3)
    if len(text) > limit:
        raise MediaError(f"{at}: the payload is {len(text)} base64 characters, above the {limit} that "
                         f"{bound} ({max_bytes} bytes) allows", status=413, code="media_too_large")
    try:
        return strict_b64decode(text)
    except (binascii.Error, ValueError):
        raise _bad(f"{at}: the payload is not valid base64") from None
