"""Where the served model's files are: the ``model`` setting as a local folder or as a Hugging
Face hub id, resolved offline in the local hub cache, as ``vllm serve`` and transformers do.
``resolve_model``: an existing folder is used as it is (it must hold ``config.json``); anything
else must be a hub id whose snapshot for ``revision`` (a branch, tag or commit hash) is in the
hub cache, found by huggingface_hub itself (``snapshot_download(local_files_only=True)``):
nothing is downloaded. A miss raises :class:`ModelNotFound` naming the id, the revision and the
cache searched (:func:`hub_cache`: the argument, else ``HF_HUB_CACHE``, else ``HF_HOME/hub``).

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path


class ModelNotFound(ValueError):
    """The ``model`` setting names no usable folder and no cached hub snapshot (a start-up error)."""


def hub_cache(cache_dir: str = "") -> Path:
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE)


def resolve_model(model: str, *, revision: str = "main", cache_dir: str = "") -> Path:
    """The folder holding ``model``'s files (see the module contract)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelNotFound(f"model folder {folder} has no config.json")
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache(cache_dir)
    try:
        snapshot = Path(snapshot_download(model, revision=revision or None, cache_dir=cache,
                                          local_files_only=True))
    except HFValidationError:
        raise ModelNotFound(f"model {model!r} is neither an existing folder nor a hub id (org/name)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"model {model!r} (revision {revision or 'main'}) is not in the Hugging Face cache "
                            f"{cache}: nothing is downloaded here; fetch it there first (`hf download {model}`), "
                            "set HF_HUB_CACHE / HF_HOME or the hub_cache_dir setting to the cache that holds "
                            "it, or give a local folder") from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"model {model!r} (revision {revision or 'main'}) in the Hugging Face cache {cache} "
                            f"has no config.json in its snapshot {snapshot} (an incomplete download?)")
    return snapshot
