"""Cache keys: what makes two embeddings interchangeable.

An embedding depends on the raw media bytes (``mm_hash``), the encoder weights and config, and
the processor settings that turn bytes into pixels. ``model_fingerprint`` hashes what of the
model directory decides those (configs in full; each weight file's size plus its first and last
MiB: cheap, the same on every host with the same files). ``cache_key`` adds the item's own
processing options.

Design: docs/design/embedding-cache.md.
"""

from __future__ import annotations

from pathlib import Path

import blake3

_CONFIGS = ("config.json", "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
_EDGE_BYTES = 1 << 20


def model_fingerprint(model_dir: str | Path) -> str:
    root = Path(model_dir)
    h = blake3.blake3()
    for name in _CONFIGS:
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                f.seek(size - _EDGE_BYTES)
                h.update(f.read(_EDGE_BYTES))
    return h.hexdigest()[:32]


def cache_key(fingerprint: str, mm_hash: str, kind: str = "image", options: str = "") -> str:
    """The item's key in the index: one per (model, processor, options, content)."""
    return blake3.blake3(f"{fingerprint}\0{kind}\0{options}\0{mm_hash}".encode()).hexdigest()[:40]
