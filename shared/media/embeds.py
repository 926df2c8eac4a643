"""Precomputed embeddings sent as a content part, parsed without pickle.

:func:`parse_embeddings`: raw bytes of one ``.npy`` file (``allow_pickle=False``) or one
safetensors file holding exactly one tensor → a float32 ``[n_tokens, hidden]`` array, or
``MediaError`` (400) saying what to fix: the wrong format, not 2-D, the wrong hidden size, no
rows, more rows than ``max_rows``, a non-float dtype, or non-finite values. ``torch.load`` is
never used.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import io

import numpy as np

from shared.media.sources import MediaError

FORMATS = ("npy", "safetensors")


def parse_embeddings(raw: bytes, *, fmt: str, hidden_size: int, max_rows: int, param: str) -> np.ndarray:
    if fmt == "npy":
        if not raw.startswith(b"\x93NUMPY"):
            raise MediaError(f"{param}: the data is not a .npy file (no \\x93NUMPY header)")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as exc:  # object arrays need pickle: refused
            raise MediaError(f"{param}: the .npy file cannot be read without pickle or is corrupt ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - numpy's errors on untrusted bytes
            raise MediaError(f"{param}: the .npy file is corrupt ({type(exc).__name__}: {str(exc)[:120]})") from None
    elif fmt == "safetensors":
        try:
            from safetensors.numpy import load

            tensors = load(raw)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise MediaError(f"{param}: the data is not a readable safetensors file ({str(exc)[:120]})") from None
        if len(tensors) != 1:
            raise MediaError(f"{param}: the safetensors file must hold exactly one tensor, it holds {len(tensors)}")
        (arr,) = tensors.values()
    else:
        raise MediaError(f"{param}: embeddings format must be one of {', '.join(FORMATS)}")
    if arr.dtype.kind != "f":
        raise MediaError(f"{param}: embeddings must be floating point, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != hidden_size:
        raise MediaError(f"{param}: embeddings have shape {tuple(arr.shape)}; this model needs [n_tokens, "
                         f"{hidden_size}] (its hidden size is {hidden_size})")
    if not 1 <= arr.shape[0] <= max_rows:
        raise MediaError(f"{param}: embeddings have {arr.shape[0]} rows; send between 1 and {max_rows}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise MediaError(f"{param}: embeddings contain NaN or infinite values")
    return arr
