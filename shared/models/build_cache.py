"""Build a model directory once per cache key, safely when several processes race.

Each builder writes into its own temp dir under the cache root and renames it into place;
``rename`` onto an existing non-empty directory fails, so the loser deletes its copy and uses
the winner's. A marker file written last inside the temp dir means "complete".

Design: docs/guide/models.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

MARKER = "mmfleet_build.json"


def recipe_hash(seed: int, recipe_files: Iterable[Path], extra: dict | None = None) -> str:
    """Short hash of everything that determines a build: the recipe's source files, the seed,
    ``extra`` (e.g. the size chosen) and the torch / transformers / tokenizers versions."""
    import tokenizers
    import torch
    import transformers

    h = hashlib.sha256()
    for module_file in recipe_files:
        h.update(Path(module_file).read_bytes())
    h.update(json.dumps({"seed": seed, "torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__, **(extra or {})}, sort_keys=True).encode())
    return h.hexdigest()[:12]


def build_once(final: Path, build: Callable[[Path], object], *, seed: int) -> Path:
    """``final`` (a directory named by its recipe's hash), built by ``build(tmp_dir)`` if missing."""
    final = Path(final)
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"name": final.name, "seed": seed}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
