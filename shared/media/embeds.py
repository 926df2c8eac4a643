"""Precomputed embeddings sent in a request, read without pickle and header first.

:func:`read_array`: one ``.npy`` file, one safetensors file holding one tensor, or (``torch``,
where the operator allows it) one ``torch.save`` blob (:mod:`shared.media.embeds_torch`) → a
numpy array. The header (shape, dtype, data length) is read and checked by the caller's
``check`` before the data is touched; nothing is allocated for a payload whose header is wrong.
:func:`parse_embeddings`: float ``[n_tokens, hidden]`` → float32; :func:`parse_ints`: a small
integer array (a grid). Every refusal is a ``MediaError`` (400) saying what to fix.
Design: docs/guide/media.md#precomputed-embeddings.
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections.abc import Callable

import numpy as np

from shared.media.sources import MediaError

FORMATS = ("npy", "safetensors", "torch")
SAFE_FORMATS = ("npy", "safetensors")
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})  # what encoders write; float64 doubles the bytes
INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U8": "uint8"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1}
MAX_SAFETENSORS_HEADER_BYTES = 64 * 1024  # one tensor's entry is ~100 bytes
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"

# (shape, dtype name) -> why they are refused, or None: run on the header, before any data is read
Check = Callable[[tuple[int, ...], str], "str | None"]


def sniff(raw: bytes) -> str:
    """The format of a payload sent without one (vLLM's form): by its first bytes."""
    if raw.startswith(NPY_MAGIC):
        return "npy"
    if raw.startswith(ZIP_MAGIC):
        return "torch"
    if len(raw) > 8 and raw[8:9] == b"{":
        return "safetensors"
    return "unknown"


def read_array(raw: bytes, *, fmt: str, check: Check, param: str, allow_torch: bool,
               max_bytes: int) -> np.ndarray:
    """The one array ``raw`` holds, once ``check`` passed its header (a read-only view where the
    bytes allow one)."""
    if fmt == "npy":
        return _npy(raw, check, param)
    if fmt == "safetensors":
        return _safetensors(raw, check, param)
    if fmt == "torch":
        if not allow_torch:
            raise MediaError(f"{param}: torch.save payloads are not taken by this server; send the tensor as "
                             f"{' or '.join(SAFE_FORMATS)} (numpy.save / safetensors.numpy.save)")
        from shared.media.embeds_torch import load_torch

        return load_torch(raw, check=check, param=param, max_bytes=max_bytes)
    raise MediaError(f"{param}: embeddings format must be one of {', '.join(FORMATS if allow_torch else SAFE_FORMATS)}"
                     + (" (the payload's first bytes match none of them)" if fmt == "unknown" else ""))


def parse_embeddings(raw: bytes, *, fmt: str, hidden_size: int, max_rows: int, param: str,
                     allow_torch: bool = False, max_bytes: int = 0) -> np.ndarray:
    """Float ``[n_tokens, hidden_size]`` with 1 <= n_tokens <= ``max_rows`` → float32, finite."""
    def check(shape: tuple[int, ...], dtype: str) -> str | None:
        if dtype not in FLOAT_DTYPES:
            return f"embeddings must be floating point (float32, float16 or bfloat16), got dtype {dtype}"
        if len(shape) != 2 or shape[1] != hidden_size:
            return (f"embeddings have shape {tuple(shape)}; this model needs [n_tokens, {hidden_size}] (its hidden "
                    f"size is {hidden_size})")
        if not 1 <= shape[0] <= max_rows:
            return f"embeddings have {shape[0]} rows; send between 1 and {max_rows}"
        return None

    arr = read_array(raw, fmt=fmt, check=check, param=param, allow_torch=allow_torch,
                     max_bytes=max_bytes or len(raw))
    out = np.ascontiguousarray(arr, dtype=np.float32)
    if not out.flags.writeable:  # a view of the request's bytes: the fleet's tensors are its own
        out = out.copy()
    if not np.isfinite(out).all():
        raise MediaError(f"{param}: embeddings contain NaN or infinite values")
    return out


def parse_ints(raw: bytes, *, fmt: str, size: int, param: str, allow_torch: bool) -> tuple[int, ...]:
    """A small integer array of ``size`` values (shape ``[size]`` or ``[1, size]``), e.g. a grid."""
    def check(shape: tuple[int, ...], dtype: str) -> str | None:
        if dtype not in INT_DTYPES:
            return f"must be an integer tensor, got dtype {dtype}"
        if tuple(shape) not in ((size,), (1, size)):
            return f"must hold {size} integers (shape [{size}] or [1, {size}]), got shape {tuple(shape)}"
        return None

    arr = read_array(raw, fmt=fmt, check=check, param=param, allow_torch=allow_torch, max_bytes=len(raw))
    return tuple(int(v) for v in np.asarray(arr).reshape(-1))


def _refuse(check: Check, shape: tuple[int, ...], dtype: str, param: str) -> None:
    why = check(shape, dtype)
    if why is not None:
        raise MediaError(f"{param}: {why}")


def _npy(raw: bytes, check: Check, param: str) -> np.ndarray:
    if not raw.startswith(NPY_MAGIC):
        raise MediaError(f"{param}: the data is not a .npy file (no \\x93NUMPY header)")
    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"format version {version} (1.0 and 2.0 are read)")
    except Exception as exc:  # noqa: BLE001 - numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise MediaError(f"{param}: the .npy file is corrupt ({type(exc).__name__}: {str(exc)[:160]})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise MediaError(f"{param}: the .npy file cannot be read without pickle (dtype {dtype}); send a plain "
                         "numeric array")
    _refuse(check, tuple(shape), dtype.name, param)  # (a name says nothing of byte order: frombuffer keeps it)
    count = math.prod(shape)
    offset = f.tell()
    if len(raw) - offset != count * dtype.itemsize:
        raise MediaError(f"{param}: the .npy file is corrupt (its header declares {count * dtype.itemsize} data "
                         f"bytes, it holds {len(raw) - offset})")
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def _safetensors(raw: bytes, check: Check, param: str) -> np.ndarray:
    def corrupt(why: str) -> MediaError:
        return MediaError(f"{param}: the data is not a readable safetensors file ({why})")

    if len(raw) < 8:
        raise corrupt("shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(MAX_SAFETENSORS_HEADER_BYTES, len(raw) - 8):
        raise corrupt(f"a header of {n} bytes")
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError) as exc:  # (a deeply nested header within the byte bound)
        raise corrupt(f"its header is not JSON: {str(exc)[:80]}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not an object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(tensors) != 1:
        raise MediaError(f"{param}: the safetensors file must hold exactly one tensor, it holds {len(tensors)}")
    (entry,) = tensors.values()
    try:
        st_dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
            raise TypeError("shape and offsets must be non-negative integers")
    except (KeyError, TypeError, ValueError) as exc:
        raise corrupt(f"a malformed tensor entry: {str(exc)[:80]}") from None
    dtype = _ST_DTYPES.get(st_dtype, str(st_dtype).lower())
    _refuse(check, shape, dtype, param)
    start = 8 + n + begin
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype] or 8 + n + end > len(raw):
        raise corrupt(f"its offsets [{begin}, {end}] do not hold shape {list(shape)} of {st_dtype}")
    if dtype == "bfloat16":  # numpy has no bfloat16: its bits are a float32's upper half
        half = np.frombuffer(raw, dtype="<u2", count=math.prod(shape), offset=start)
        return (half.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"), count=math.prod(shape),
                         offset=start).reshape(shape)
