"""Embedding payloads as clients write them (numpy.save, safetensors, torch.save) and hostile ones
(a pickled callable, a compressed zip that expands far past its bytes, a zip directory that
declares more than it holds), shared by the decoder, gateway and fleet tests."""

from __future__ import annotations

import base64
import io
import os
import struct
import zipfile

import numpy as np


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def npy(arr, **kw) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True, **kw)
    return buf.getvalue()


def safetensors_bytes(**tensors) -> bytes:
    from safetensors.numpy import save

    return save(tensors)


def torch_blob(obj, **kw) -> bytes:
    """What vLLM's ``tensor2base64`` encodes: ``torch.save`` of the object."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


class _Callable:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def callable_pickle_blob() -> bytes:
    return torch_blob(_Callable())


def zip_bomb_blob(expanded_bytes: int = 8 << 20) -> bytes:
    """A torch.save zip whose storage entry is deflated: small on the wire, huge once read."""
    import torch

    src = zipfile.ZipFile(io.BytesIO(torch_blob(torch.zeros(4, 128))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.endswith("data/0"):
                dst.writestr(info.filename, bytes(expanded_bytes), compress_type=zipfile.ZIP_DEFLATED)
            else:
                dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def lying_zip_blob(declared_bytes: int = 1 << 31) -> bytes:
    """A torch.save zip whose central directory declares its storage entry ``declared_bytes`` long."""
    import torch

    raw = bytearray(torch_blob(torch.zeros(4, 128)))
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46:at + 46 + name_len].endswith(b"data/0"):
            struct.pack_into("<II", raw, at + 20, declared_bytes, declared_bytes)
        at = raw.find(b"PK\x01\x02", at + 4)
    return bytes(raw)
