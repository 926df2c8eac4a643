"""Deterministic test images, named by what they are: ``<seed>-<w>x<h>.<png|jpg>``.

Contract: the same name gives the same bytes (same Pillow/numpy versions) in every process,
so the media server and ``data:`` URLs of one workload carry identical images, and a target
that hashes content (the fleet's mm_hash) sees repeats exactly where the workload repeats.
Images are smooth colour fields with mild noise: realistic compressed sizes (pure noise would
make PNGs as large as raw pixels), and every seed looks different to the encoder.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

FORMATS = {"png": ("PNG", "image/png"), "jpg": ("JPEG", "image/jpeg")}
_NAME = re.compile(r"^(?P<seed>\d+)-(?P<w>\d+)x(?P<h>\d+)\.(?P<ext>png|jpg)$")
MAX_SIDE = 4096  # refuse absurd names: the server renders whatever it is asked for


@dataclass(frozen=True)
class ImageRef:
    seed: int
    width: int
    height: int
    fmt: str = "png"  # "png" | "jpg"

    @property
    def name(self) -> str:
        return f"{self.seed}-{self.width}x{self.height}.{self.fmt}"

    @property
    def mime(self) -> str:
        return FORMATS[self.fmt][1]


def parse_name(name: str) -> ImageRef:
    """Inverse of ``ImageRef.name``; ``ValueError`` on anything else."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"bad image name {name!r}; expected <seed>-<w>x<h>.png|jpg")
    ref = ImageRef(int(m["seed"]), int(m["w"]), int(m["h"]), m["ext"])
    if not (1 <= ref.width <= MAX_SIDE and 1 <= ref.height <= MAX_SIDE):
        raise ValueError(f"image sides must be 1..{MAX_SIDE}")
    return ref


@lru_cache(maxsize=512)
def image_bytes(ref: ImageRef) -> bytes:
    """The encoded image (cached: workloads reuse images and the server serves them often)."""
    rng = np.random.default_rng(ref.seed)
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((ref.width, ref.height), Image.Resampling.BICUBIC)
    noise = rng.integers(-12, 13, (ref.height, ref.width, 3), dtype=np.int16)
    arr = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    pil_format = FORMATS[ref.fmt][0]
    Image.fromarray(arr).save(buf, format=pil_format, **({"quality": 90} if pil_format == "JPEG" else {}))
    return buf.getvalue()


def data_url(ref: ImageRef) -> str:
    return f"data:{ref.mime};base64," + base64.b64encode(image_bytes(ref)).decode()
