"""Cache keys: what makes two embeddings interchangeable.

An embedding depends on the raw media bytes (``mm_hash``), the encoder weights and config, and
the processor settings that turn bytes into pixels. ``model_fingerprint`` hashes what of the
model directory decides those (configs in full; each weight file's size plus its first and last
MiB: cheap, the same on every host with the same files). ``cache_key`` adds the item's own
processing options. A request's cache scope (:func:`scope_of`: its tenant and ``cache_salt``)
enters every item hash it makes; an item the client named (``uuid``) is hashed by that name in
its scope (:func:`named_hash`), never by its bytes.

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


def scope_of(tenant: str, salt: str) -> str:
    """A request's cache scope: "" (the fleet-wide one) when it has neither a tenant nor a salt,
    else a digest of both (fixed length, whatever the salt; neither is readable from it)."""
    if not tenant and not salt:
        return ""
    return blake3.blake3(f"scope\0{tenant}\0{salt}".encode()).hexdigest()[:32]


def named_hash(kind: str, uuid: str, scope: str, options: str) -> str:
    """The item hash of a client-named item: its name within its scope and with the processing
    options it was asked with (``options``), so one tenant's name never reaches another's item."""
    return blake3.blake3(f"uuid\0{scope}\0{kind}\0{options}\0{uuid}".encode()).hexdigest()


def source_options(min_pixels: int, max_pixels: int, num_frames: int, fps: float) -> str:
    """The processing options a request asked for an item, as :func:`named_hash` takes them."""
    return f"{min_pixels}:{max_pixels}:{num_frames}:{fps!r}"
