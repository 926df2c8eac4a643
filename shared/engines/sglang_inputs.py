"""Prompt token ids + precomputed media embeddings → ``sglang.Engine.async_generate``'s prompt
arguments (:class:`PromptBuilder`). Imports no SGLang. SGLang's Qwen-VL processor decodes the
ids to text, re-tokenises it and finds each item by its run of placeholder tokens, so the prompt
carries each placeholder EXPANDED to its item's token count; a modality's items travel as ONE
``processor_output`` dict (``precomputed_embeddings`` + ``<kind>_grid_thw``), as SGLang's
``validate_mm_data`` demands. Items are checked against placeholders and grids before a request
costs the engine anything.

Design: docs/design/sglang-engine.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engines.base import EngineError, MediaEmbeds

ENGINE = "sglang"
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
DATA_KEYS = {"image": "image_data", "video": "video_data", "audio": "audio_data"}


class PromptBuilder:
    """One model's prompt rules: its family, placeholder ids and Qwen's merge size.
    ``modalities``: what to take as embeddings (default: what ``shared.models.registry`` says
    the fleet serves with SGLang, ValueError when the family is not served at all)."""

    def __init__(self, model_dir: str | Path, tokenizer, max_items_per_prompt: int,
                 modalities: frozenset[str] | None = None) -> None:
        from shared.models.registry import family_of, merge_size, placeholder_ids, served_modalities

        family = family_of(model_dir)
        self.family = family.name
        served = served_modalities(family, ENGINE)  # ValueError (with the reason) if not served
        self.modalities = served if modalities is None else frozenset(modalities) & family.modalities
        if self.modalities and self.family not in QWEN_FAMILIES:
            raise ValueError(f"the sglang engine maps embeddings of Qwen-VL models only, not {self.family}")
        self.placeholders = placeholder_ids(family, self.modalities, tokenizer, model_dir)
        self.merge_size = merge_size(model_dir)
        self.max_items = max_items_per_prompt

    def build(self, prompt_ids: list[int], media: list[MediaEmbeds], tail: tuple[int, ...] = ()) -> dict:
        """``async_generate``'s ``input_ids`` (placeholders expanded, then ``tail``: completion
        tokens already produced) and one ``<kind>_data`` list per modality present."""
        by_kind: dict[str, list[MediaEmbeds]] = {}
        for item in media:
            by_kind.setdefault(getattr(item, "kind", "image"), []).append(item)
        other = sorted(set(by_kind) - self.modalities)
        if other:
            served = ", ".join(sorted(self.modalities)) or "no"
            raise EngineError(f"the sglang engine serves {served} embeddings of {self.family} models, "
                              f"not {', '.join(other)}")
        if len(media) > self.max_items:
            raise EngineError(f"{len(media)} media items exceed this engine's limit of {self.max_items} per prompt")
        for kind in sorted(self.modalities):
            n_placeholders = sum(1 for t in prompt_ids if t == self.placeholders[kind])
            n_items = len(by_kind.get(kind, ()))
            if n_placeholders != n_items:
                raise EngineError(f"prompt has {n_placeholders} {kind} placeholders but {n_items} {kind} items given")
            if n_items > 1:  # SGLang's prompt scan counts N item runs against the one dict: another path, unchecked
                raise EngineError(f"the sglang engine takes one {kind} per request from embeddings, got {n_items}")
        counts = {self.placeholders[k]: self._tokens(k, items[0]) for k, items in by_kind.items()}
        ids: list[int] = []
        for t in prompt_ids:
            ids.extend([t] * counts[t] if t in counts else [t])
        out: dict = {"input_ids": [*ids, *(int(t) for t in tail)]}  # ids, not SampledToken
        for kind, items in by_kind.items():
            out[DATA_KEYS[kind]] = [self._qwen_dict(kind, items)]
        return out

    def _tokens(self, kind: str, item: MediaEmbeds) -> int:
        emb, (t, h, w) = item[0], tuple(item[1])
        n = t * h * w // (self.merge_size**2)
        if emb.dim() != 2 or emb.shape[0] != n or n < 1:
            raise EngineError(f"{kind} embedding of shape {tuple(emb.shape)} does not fit grid {(t, h, w)} "
                              f"({n} tokens)")
        return n

    @staticmethod
    def _qwen_dict(kind: str, items: list[MediaEmbeds]) -> dict:
        """SGLang's ``processor_output`` item (base_processor.collect_mm_items_from_processor_output)."""
        return {"format": "processor_output", "modality": kind.upper(),
                "precomputed_embeddings": torch.cat([it[0].to(torch.float32) for it in items], dim=0).contiguous(),
                f"{kind}_grid_thw": torch.tensor([tuple(it[1]) for it in items], dtype=torch.long)}
