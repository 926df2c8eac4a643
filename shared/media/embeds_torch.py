"""``torch.save`` payloads (vLLM clients' ``tensor2base64`` form), read only after their zip
directory is checked and only with ``torch.load(weights_only=True)``.

Before any load: the zip's central directory (read, nothing extracted) has a bounded number of
entries, every entry stored uncompressed (so no entry can expand past the payload: no zip bomb),
declared sizes within the payload and ``max_bytes``, and a small ``data.pkl``. ``weights_only``
refuses any pickle global beyond tensors and plain containers (a pickled callable is a 400).
The one object loaded must be a dense CPU ``torch.Tensor`` whose shape and dtype pass ``check``.
Design: docs/guide/security.md#precomputed-embeddings.
"""

from __future__ import annotations

import io
import re
import zipfile

import numpy as np

from shared.media.sources import MediaError

MAX_ENTRIES = 64  # torch.save writes ~7 for one tensor
MAX_PICKLE_BYTES = 64 * 1024  # one tensor's pickle is ~200 bytes; bounds what the unpickler builds


def check_zip(raw: bytes, *, param: str, max_bytes: int) -> None:
    """The directory bounds above, or ``MediaError`` (400) naming the one broken."""
    def bad(why: str) -> MediaError:
        return MediaError(f"{param}: the torch.save payload is refused: {why}")

    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise bad(f"not a readable zip archive ({str(exc)[:120]})") from None
    if len(infos) > MAX_ENTRIES:
        raise bad(f"{len(infos)} zip entries (at most {MAX_ENTRIES})")
    limit = min(max_bytes, len(raw))
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise bad(f"entry {info.filename!r} is compressed (torch.save stores entries uncompressed)")
        if info.file_size != info.compress_size or info.header_offset + info.file_size > len(raw):
            raise bad(f"entry {info.filename!r} declares {info.file_size} bytes beyond the payload")
        total += info.file_size
        if total > limit:
            raise bad(f"its entries declare {total}+ bytes, above {limit}")
    pickles = [i for i in infos if i.filename.endswith("data.pkl")]
    if len(pickles) != 1:
        raise bad(f"{len(pickles)} data.pkl entries (torch.save writes one)")
    if pickles[0].file_size > MAX_PICKLE_BYTES:
        raise bad(f"its data.pkl is {pickles[0].file_size} bytes (at most {MAX_PICKLE_BYTES} for one tensor)")


def load_torch(raw: bytes, *, check, param: str, max_bytes: int) -> np.ndarray:
    """The one tensor of a checked ``torch.save`` zip, as numpy (bfloat16 widened to float32)."""
    import torch

    if not raw.startswith(b"PK\x03\x04"):
        raise MediaError(f"{param}: the torch.save payload is refused: not a zip archive (the legacy "
                         "non-zip format is not read)")
    check_zip(raw, param=param, max_bytes=max_bytes)
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True, mmap=False)
    except Exception as exc:  # noqa: BLE001 - the unpickler's and the zip reader's errors on untrusted bytes
        # torch's message opens with advice to load with weights_only=False: keep only its finding
        found = re.search(r"(unsupported|Unsupported)[^\n]*", str(exc))
        why = found.group(0)[:160] if found else f"{type(exc).__name__}: {str(exc)[:160]}"
        raise MediaError(f"{param}: the torch.save payload is refused by torch.load(weights_only=True): "
                         f"{why}") from None
    if type(obj) is not torch.Tensor:
        raise MediaError(f"{param}: the torch.save payload must hold one plain tensor, it holds "
                         f"{type(obj).__name__}")
    if obj.layout != torch.strided or obj.is_quantized or obj.device.type != "cpu":
        raise MediaError(f"{param}: the tensor must be dense (strided), got layout {obj.layout}")
    dtype = str(obj.dtype).removeprefix("torch.")
    why = check(tuple(obj.shape), dtype)
    if why is not None:
        raise MediaError(f"{param}: {why}")
    obj = obj.detach()
    return (obj.to(torch.float32) if dtype == "bfloat16" else obj).contiguous().numpy()
