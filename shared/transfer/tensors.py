"""What the transfer layer shares with its callers: the dtypes a pool can hold, the error
vocabulary, and the checks that turn a tensor into pool bytes and a ``TensorRef`` back.

Design: docs/design/transfer.md.
"""

from __future__ import annotations

import math

import torch

from shared.protocol import TensorRef

__all__ = ["DTYPES", "TransferError", "PoolFullError", "OwnerGoneError", "as_bytes", "check_ref"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class TransferError(Exception):
    """Base class of transfer failures."""


class PoolFullError(TransferError):
    """No slot large enough is free in this process's pool (now, or within the wait)."""


class OwnerGoneError(TransferError):
    """The owner cannot serve the tensor (dead, unreachable, lease gone): recompute it."""


def as_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A flat uint8 view of a contiguous copy of ``tensor`` (on its own device: CPU or CUDA)
    and its dtype's name."""
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"put needs a CPU or CUDA tensor, got {tensor.device}")
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"unsupported dtype {tensor.dtype}; supported: {list(DTYPES)}")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8), name


def check_ref(ref: TensorRef) -> torch.dtype:
    """The ref's torch dtype; ValueError if the dtype is unknown or nbytes disagrees."""
    dtype = DTYPES.get(ref.dtype)
    if dtype is None:
        raise ValueError(f"unsupported dtype {ref.dtype!r}")
    if math.prod(ref.shape) * dtype.itemsize != ref.nbytes:
        raise ValueError(f"ref nbytes {ref.nbytes} != shape {ref.shape} x {ref.dtype}")
    return dtype
