"""A saved model rewritten the way the Hugging Face hub keeps one (the repository's files and the
local cache around them), built offline, so hub-id serving is tested on that very layout:
:func:`save_hub_files` writes a model as hub VLM repositories hold it (sharded safetensors with
an index, the tokenizer's and processors' files, the chat template as ``chat_template.json`` or
``chat_template.jinja``); :func:`place_in_hub_cache` puts those files into a hub cache as
``huggingface_hub`` downloads them (blobs, a snapshot of symlinks, ``refs/<revision>``).

Design: docs/guide/models.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def save_hub_files(src: Path, out: Path, *, model_cls, dtype=None, max_shard_size: str = "1MB",
                   template_file: str = "json", tokenizer_template: str | None = None) -> Path:
    """The model at ``src`` (any folder ``from_pretrained`` loads) written to ``out``:
    ``config.json`` + ``generation_config.json``, weights as sharded safetensors with
    ``model.safetensors.index.json`` (``max_shard_size``) in ``dtype``, the tokenizer's files (its
    own template in ``tokenizer_config.json`` when ``tokenizer_template`` is given),
    ``preprocessor_config.json`` (and ``video_preprocessor_config.json`` where the family has a
    video processor), and the processor's chat template in ``chat_template.json`` (the older hub
    form) or ``chat_template.jinja``; no ``processor_config.json``."""
    import torch
    from transformers import AutoProcessor

    if template_file not in ("json", "jinja"):
        raise ValueError(f"template_file must be json or jinja, not {template_file!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    processor = AutoProcessor.from_pretrained(str(src))
    model = model_cls.from_pretrained(str(src), dtype=dtype or torch.float32)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer = processor.tokenizer
    template = processor.chat_template
    tokenizer.chat_template = tokenizer_template
    tokenizer.save_pretrained(out)
    tokenizer_jinja = out / "chat_template.jinja"  # the tokenizer's, written beside its files
    if tokenizer_jinja.exists():
        tokenizer_jinja.unlink()
    if tokenizer_template is not None:  # where hub repos keep the tokenizer's own template
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = tokenizer_template
        config_path.write_text(json.dumps(config, indent=2))
    for part in ("image_processor", "video_processor", "feature_extractor"):
        if getattr(processor, part, None) is not None:
            getattr(processor, part).save_pretrained(out)
    if template_file == "json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    else:
        (out / "chat_template.jinja").write_text(template)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def place_in_hub_cache(files: Path, cache_dir: Path, repo_id: str, *, revision: str = "main",
                       skip: tuple[str, ...] = ()) -> Path:
    """``files`` put into the hub cache at ``cache_dir`` as ``huggingface_hub`` downloads them:
    ``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<path>`` as relative symlinks to the
    blobs, ``refs/<revision>`` holding the commit (a deterministic 40-hex digest of the files).
    Returns the snapshot folder. ``skip``: names of files in ``files`` that are not part of the
    repository."""
    files, cache_dir = Path(files), Path(cache_dir)
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    digests = {p.relative_to(files).as_posix(): _sha256(p) for p in sorted(files.rglob("*"))
               if p.is_file() and p.relative_to(files).as_posix() not in skip}
    commit = hashlib.sha1(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(files / rel, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
