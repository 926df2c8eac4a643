"""Prompt token ids + precomputed media embeddings → vLLM's prompt (:class:`PromptBuilder`), for
each family vLLM can serve from embeddings (``enable_mm_embeds``). Imports no vLLM. The prompt
carries ONE placeholder token per item; vLLM expands each to the item's token count and takes
each modality's items in the order of its placeholders. Each item's ``mm_hash`` goes as vLLM's
``multi_modal_uuids``, so vLLM's prefix cache names an item by its bytes, as ours does.
Checkpoints vLLM's loader cannot read are refused at start, with the reason
(:func:`checkpoint_refusal`).

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.engines.base import EngineError, MediaEmbeds

ENGINE = "vllm"


# family -> (a key prefix only transformers-5 saves have, that prefix's part to rewrite, what the hub
# layout vLLM 0.32 loads has there): checkpoints saved by transformers 5 nest some modules
# differently from the hub's, and vLLM's loaders map only the hub's names
TRANSFORMERS5_LAYOUTS: dict[str, tuple[str, str, str]] = {
    "llava": ("vision_tower.embeddings.", "vision_tower.", "vision_tower.vision_model."),
    "qwen2_audio": ("language_model.model.model.", "language_model.model.model.", "language_model.model."),
}


def checkpoint_refusal(model_dir: str | Path, family: str) -> str | None:
    """Why vLLM cannot load the weights at ``model_dir`` (None: it can, as far as known). Reads
    only the safetensors headers. LLaVA and Qwen2-Audio checkpoints saved by transformers 5 (the
    tiny offline builds are) are refused with that reason rather than failing inside vLLM's
    loader; the same weights renamed to the hub layout load and serve."""
    layout = TRANSFORMERS5_LAYOUTS.get(family)
    if layout is None:
        return None
    from safetensors import safe_open

    marker, old, new = layout
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            bad = next((k for k in f.keys() if k.startswith((marker, "model." + marker))), None)
        if bad is not None:
            return (f"vLLM 0.32 cannot load this {family} checkpoint: it was saved in transformers 5's layout "
                    f"({bad!r}) where vLLM's loader expects the hub's ('{old}*' as '{new}*'); re-save it in the "
                    f"hub layout or use --engine transformers")
    return None


class PromptBuilder:
    """One model's prompt rules (family, placeholder ids, Qwen's merge size). What each family
    gets (checked against ``generate()`` in tests/engines/test_vllm_families.py):

    - Qwen2-VL / Qwen2.5-VL: ``{"image": {"image_embeds": cat [Σn, hidden], "image_grid_thw":
      [N, 3]}}``, and the same for ``video``: vLLM splits the rows by ``t·h·w / merge²`` and
      takes the M-RoPE positions from the grids.
    - LLaVA: ``{"image": [embeds, ...]}`` (vLLM's generic image-embedding items; the projector
      already ran in our encoder); Qwen2-Audio: ``{"audio": [embeds, ...]}`` likewise.
    - LLaVA-NeXT-Video: refused at start (``shared.models.registry``): vLLM's model takes
      ``pixel_values_videos`` only, no video embeddings.

    Items without an ``mm_hash`` (a decode consumer's zero placeholders) get no uuid, so zeros
    never enter a cache under a real item's name."""

    def __init__(self, model_dir: str | Path, tokenizer, max_items_per_prompt: int,
                 per_modality: dict[str, int] | None = None) -> None:
        """``max_items_per_prompt``: media items of all kinds together; ``per_modality``: each
        kind's own limit (vLLM's ``limit_mm_per_prompt``; default: the total), at most the total."""
        from shared.models.registry import family_of, served_modalities

        family = family_of(model_dir)
        self.family = family.name
        self.modalities = served_modalities(family, ENGINE)  # ValueError (with the reason) if not served
        why = checkpoint_refusal(model_dir, family.name)
        if why:
            raise ValueError(why)
        self.placeholders: dict[str, int] = {}
        for modality in sorted(self.modalities):
            token = family.placeholders[modality]
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer at {model_dir} has no {token!r} token")
            self.placeholders[modality] = int(tid)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.merge_size = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
        self.max_items = max_items_per_prompt
        self._per_modality = dict(per_modality or {})

    def limits(self) -> dict[str, int]:
        """vLLM's ``limit_mm_per_prompt`` for the served modalities."""
        return {m: min(self._per_modality.get(m, self.max_items), self.max_items) for m in sorted(self.modalities)}

    def build(self, prompt_ids: list[int], media: list[MediaEmbeds], tail: tuple[int, ...] = ()) -> dict:
        """vLLM's prompt dict; ``tail``: completion tokens appended after the placeholders are
        counted (a generated token may equal a placeholder id)."""
        by_kind: dict[str, list[MediaEmbeds]] = {}
        for item in media:
            by_kind.setdefault(getattr(item, "kind", "image"), []).append(item)
        other = sorted(set(by_kind) - self.modalities)
        if other:
            raise EngineError(f"the vllm engine serves {', '.join(sorted(self.modalities))} embeddings of "
                              f"{self.family} models, not {', '.join(other)}")
        for kind in sorted(self.modalities):
            n_placeholders = sum(1 for t in prompt_ids if t == self.placeholders[kind])
            n_items = len(by_kind.get(kind, ()))
            if n_placeholders != n_items:
                raise EngineError(f"prompt has {n_placeholders} {kind} placeholders but {n_items} {kind} items given")
        prompt: dict = {"prompt_token_ids": [*prompt_ids, *(int(t) for t in tail)]}  # ids, not SampledToken
        if not media:
            return prompt
        if len(media) > self.max_items:
            raise EngineError(f"{len(media)} media items exceed this engine's limit of {self.max_items} per prompt")
        data: dict = {}
        uuids: dict[str, list[str | None]] = {}
        for kind, items in by_kind.items():
            data[kind] = self._qwen_dict(kind, items) if self.family in ("qwen2_vl", "qwen2_5_vl") \
                else self._plain_list(kind, items)
            if any(getattr(it, "mm_hash", "") for it in items):
                uuids[kind] = [getattr(it, "mm_hash", "") or None for it in items]
        prompt["multi_modal_data"] = data
        if uuids:
            prompt["multi_modal_uuids"] = uuids
        return prompt

    def _qwen_dict(self, kind: str, items: list[MediaEmbeds]) -> dict:
        embeds, grids = [], []
        for item in items:
            emb, (t, h, w) = item[0], tuple(item[1])
            n = t * h * w // (self.merge_size**2)
            if emb.dim() != 2 or emb.shape[0] != n:
                raise EngineError(f"{kind} embedding of shape {tuple(emb.shape)} does not fit grid {(t, h, w)} "
                                  f"({n} tokens)")
            embeds.append(emb.to(torch.float32))
            grids.append((t, h, w))
        return {f"{kind}_embeds": torch.cat(embeds, dim=0).contiguous(),
                f"{kind}_grid_thw": torch.tensor(grids, dtype=torch.long)}

    @staticmethod
    def _plain_list(kind: str, items: list[MediaEmbeds]) -> list[torch.Tensor]:
        out = []
        for item in items:
            emb = item[0]
            if emb.dim() != 2 or emb.shape[0] < 1:
                raise EngineError(f"{kind} embedding of shape {tuple(emb.shape)} is not [n_tokens, hidden]")
            out.append(emb.to(torch.float32).contiguous())
        return out
