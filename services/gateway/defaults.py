"""What a request that names no sampling field or ``max_tokens`` gets: ``vllm serve``'s rules.

:func:`load` reads the model's sampling defaults from its ``generation_config.json`` (the
``generation_config`` setting: ``auto`` the model's, ``vllm`` none, or another folder's), the
fields vLLM takes from it and nothing else. :func:`max_tokens` is a request's budget: what it
asks for, else the default's ``max_new_tokens``, else the rest of the context (under
``default_max_tokens`` when set). Design: docs/guide/api.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

# the generation-config fields vLLM's get_diff_sampling_param takes, by their request names
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """Values for the sampling fields a request leaves out (None: the API's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None

    def pick(self, name: str, requested):
        """The request's value, else this default, else None."""
        return requested if requested is not None else getattr(self, name)


def load(model_dir: str | Path, setting: str) -> GenerationDefaults:
    """``setting``: ``auto`` (the model folder's generation config), ``vllm`` (no model defaults)
    or a folder holding a ``generation_config.json``. A folder without one gives no defaults."""
    if setting == "vllm":
        return GenerationDefaults()
    from transformers import GenerationConfig

    source = Path(model_dir) if setting == "auto" else Path(setting)
    try:
        config = GenerationConfig.from_pretrained(source).to_diff_dict()
    except OSError:  # no generation_config.json: vLLM then has none either
        return GenerationDefaults()
    picked = {ours: config[theirs] for theirs, ours in _FIELDS.items() if config.get(theirs) is not None}
    if picked:
        log.info("sampling defaults from %s's generation config: %s (generation_config=vllm turns them off)",
                 source, picked)
    return msgspec.convert(picked, GenerationDefaults)


def max_tokens(requested: int | None, defaults: GenerationDefaults, *, default_cap: int,
               context_left: int) -> int:
    """The request's max_tokens: what it asks for, else the model's default, else the rest of the
    context (under ``default_cap`` when set). ``context_left``: the context minus the prompt as
    far as the gateway knows it (media placeholders count one token each: an upper bound; prefill
    lowers every budget to what the media tokens leave, as vLLM's get_max_tokens does)."""
    if requested is not None:
        return requested
    value = defaults.max_tokens if defaults.max_tokens is not None else context_left
    return min(value, default_cap) if default_cap else value
