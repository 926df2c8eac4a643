"""Loading only the part of a checkpoint a worker runs, in the checkpoint's dtype. Every family
served is a transformers ``*ForConditionalGeneration`` with the LM (``model.language_model`` +
``lm_head``) beside its media encoder under ``model``. :func:`shared.engines.registry.parts_for` says what a worker's
transformers engine needs (the encoder for encode, the LM for prefill / decode, both with no
stages named); :func:`load_parts` loads those with the other part's modules replaced by empty
ones before any weight is read (neither read nor allocated); :func:`weight_bytes` counts what is
held; :func:`checkpoint_dtype` is what the ``dtype`` setting ``auto`` loads.

Design: docs/guide/models.md.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch

ENCODER = "encoder"
LM = "lm"
ALL_PARTS = frozenset({ENCODER, LM})
_LM_MODULES = ("model.language_model", "lm_head")

log = logging.getLogger(__name__)


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype the checkpoint's weights are saved in (its config's ``dtype``)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(str(model_dir)), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _dropped(model: torch.nn.Module, parts: frozenset[str]) -> list[str]:
    """Module paths of the parts not loaded."""
    if parts >= ALL_PARTS:
        return []
    if parts == {ENCODER}:
        return list(_LM_MODULES)
    return [f"model.{name}" for name, _ in model.model.named_children() if name != "language_model"]


class _Absent(torch.nn.Module):
    """A part this process does not load: no parameters, but ``device`` / ``dtype`` answered as
    the model's (some forwards read them off a tower they do not run, e.g. Qwen2-Audio's)."""

    def __init__(self, owner: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", weakref.ref(owner))  # not a submodule: no cycle

    @property
    def device(self) -> torch.device:
        return self._owner().device

    @property
    def dtype(self) -> torch.dtype:
        return self._owner().dtype


def _partial_class(model_cls, parts: frozenset[str]):
    """``model_cls`` whose instances hold only ``parts``: the other part's modules are empty ones
    (transformers' own loader skips keys the model does not have; the key renames it applies to
    older hub checkpoints still apply)."""

    class Partial(model_cls):
        # nothing to tie the LM head to when the LM is not there
        _tied_weights_keys = {} if LM not in parts else model_cls._tied_weights_keys

        @classmethod
        def is_custom_code(cls) -> bool:  # the library's own class, so its checkpoint key renames apply
            return model_cls.is_custom_code()

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)  # under from_pretrained: on the meta device
            for path in _dropped(self, parts):
                parent, _, name = path.rpartition(".")
                setattr(self.get_submodule(parent) if parent else self, name, _Absent(self))

    # the very class name: transformers picks the key renames of older hub checkpoints by it
    Partial.__name__ = Partial.__qualname__ = model_cls.__name__
    return Partial


def load_parts(model_cls, model_dir: str | Path, placement, parts: frozenset[str] = ALL_PARTS):
    """The model with only ``parts`` loaded, in ``placement``'s dtype and on its device, eval mode."""
    parts = frozenset(parts)
    if not parts or not parts <= ALL_PARTS:
        raise ValueError(f"parts must be a non-empty subset of {sorted(ALL_PARTS)}, not {sorted(parts)}")
    cls = model_cls if parts == ALL_PARTS else _partial_class(model_cls, parts)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the part not loaded shows up as "unexpected keys": expected here
    try:
        model = cls.from_pretrained(str(model_dir), dtype=placement.dtype)
    finally:
        hf_logging.set_verbosity(level)
    return model.to(placement.device).eval()


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """{part: bytes of the parameters and buffers it holds}."""
    out = {ENCODER: 0, LM: 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[LM if name.startswith(tuple(m + "." for m in _LM_MODULES)) else ENCODER] += t.numel() * t.element_size()
    return out


def resident_bytes() -> int:
    """This process's resident set size now (Linux; 0 where /proc is not there)."""
    import os

    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
