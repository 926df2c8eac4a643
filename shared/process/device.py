"""Where a worker computes: the ``device`` and ``dtype`` settings as torch objects
(:func:`resolve_placement`: ``auto`` is a bf16/fp16 checkpoint's own dtype, else bfloat16 on
CUDA and float32 on CPU; a GPU asked for and not visible is a ``ValueError``, never a silent CPU
fallback), and the host facts the transfer layer needs: ``host_id()`` (stable for one boot of
one machine; CUDA IPC handles are opened only between equal host ids), ``device_uuid`` /
``local_index`` (a GPU named independently of ``CUDA_VISIBLE_DEVICES``).

Design: docs/design/transfer.md.
"""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["Placement", "resolve_placement", "cuda_available", "host_id", "device_uuid", "local_index",
           "keep_triton_out"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """One worker's compute device and the dtype its models are loaded in."""

    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_placement(device: str = "cpu", dtype: str = "auto",
                      checkpoint_dtype: torch.dtype | None = None) -> Placement:
    """Validate the two settings and return the placement (see module contracts)."""
    dev = device.strip().lower()
    if dev != "cpu" and dev != "cuda" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    tdev = torch.device(dev)
    if tdev.type == "cuda":
        if not cuda_available():
            raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
        index = 0 if tdev.index is None else tdev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) visible")
        tdev = torch.device("cuda", index)
    if dtype == "auto" and checkpoint_dtype in (torch.bfloat16, torch.float16):
        tdtype = checkpoint_dtype
    elif dtype == "auto":  # a float32 checkpoint (or none known)
        tdtype = torch.bfloat16 if tdev.type == "cuda" else torch.float32
    elif dtype in _DTYPES:
        tdtype = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return Placement(tdev, tdtype)


def keep_triton_out(device: str) -> None:
    """On ``device`` ``cpu``: make ``import triton`` fail in this process (and in what it forks).
    Call it before ``torch._dynamo`` is imported (torchvision imports it, through transformers'
    processors), which imports triton when installed only to note that it is; triton serves
    GPU kernels alone. Imported, triton's types are reported as leaked at exit, because a fleet
    process freezes its heap then (``shared.process.gcpolicy``): pages of warnings on Ctrl-C."""
    if device.strip().lower() == "cpu":
        sys.modules.setdefault("triton", None)


@lru_cache(maxsize=1)
def host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the hostname alone (IPC then also needs the same GPU uuid)
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int | None:
    if not cuda_available():
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None
