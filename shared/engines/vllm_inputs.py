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

from pathlib import Path

import torch

from shared.engines.base import EngineError, MediaEmbeds
from shared.models.weight_layout import TRANSFORMERS5_LAYOUTS

ENGINE = "vllm"


def checkpoint_refusal(model_dir: str | Path, family: str) -> str | None:
    """Why vLLM cannot load the weights at ``model_dir`` (None: it can, as far as known). Reads
    only the safetensors headers. LLaVA(-NeXT, -NeXT-Video) and Qwen2-Audio checkpoints as a
    fresh transformers-5 model saves them are refused with that reason rather than failing inside
    vLLM's loader; the same weights renamed to the hub layout (as the tiny builds keep theirs:
    :mod:`shared.models.weight_layout`) load and serve."""
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
      takes the M-RoPE positions from the grids. Qwen2.5-VL videos add ``second_per_grid_ts``
      ``[N]`` (each clip's time step, from its sampled fps): their temporal positions step by it.
    - LLaVA: ``{"image": [embeds, ...]}`` (vLLM's generic image-embedding items; the projector
      already ran in our encoder); Qwen2-Audio: ``{"audio": [embeds, ...]}`` likewise.
    - Raw media (``registry.ENGINE_RAW_MEDIA``: LLaVA-NeXT's images and LLaVA-NeXT-Video's
      videos): ``{"image": [PIL, ...]}``, ``{"video": [frames uint8 [T, H, W, 3], ...]}``; vLLM's
      own processor and encoder run on them. Decode apart gets their placeholders expanded in
      its ids instead (:meth:`expand_raw`: their KV is loaded, no media needed).

    Items without an ``mm_hash`` (a decode consumer's zero placeholders) get no uuid, so zeros
    never enter a cache under a real item's name."""

    def __init__(self, model_dir: str | Path, tokenizer, max_items_per_prompt: int,
                 per_modality: dict[str, int] | None = None) -> None:
        """``max_items_per_prompt``: media items of all kinds together; ``per_modality``: each
        kind's own limit (vLLM's ``limit_mm_per_prompt``; default: the total), at most the total."""
        from shared.models.registry import family_of, merge_size, placeholder_ids, raw_modalities, served_modalities

        family = family_of(model_dir)
        self.family = family.name
        self.modalities = served_modalities(family, ENGINE)  # ValueError (with the reason) if not served
        self.raw = raw_modalities(family, ENGINE)
        why = checkpoint_refusal(model_dir, family.name)
        if why:
            raise ValueError(why)
        self.placeholders = placeholder_ids(family, self.modalities, tokenizer, model_dir)
        self.merge_size = merge_size(model_dir)
        self.max_items = max_items_per_prompt
        self._per_modality = dict(per_modality or {})

    def limits(self) -> dict[str, int]:
        """vLLM's ``limit_mm_per_prompt`` for the served modalities."""
        return {m: min(self._per_modality.get(m, self.max_items), self.max_items) for m in sorted(self.modalities)}

    def expand_raw(self, prompt_ids: list[int], media) -> tuple[list[int], list]:
        """(``prompt_ids`` with each raw-media item's placeholder repeated its ``n_tokens``, the
        other items of ``media``): a decode consumer's prompt, whose raw items' KV is loaded."""
        counts = {k: [m.n_tokens for m in media if m.kind == k] for k in self.raw}
        by_id = {self.placeholders[k]: list(reversed(counts[k])) for k in self.raw}
        if any(sum(1 for t in prompt_ids if t == tid) != len(n) for tid, n in by_id.items()):
            raise EngineError(f"prompt's raw-media placeholders do not match its items {counts}")
        ids: list[int] = []
        for t in prompt_ids:
            ids.extend([t] * (by_id[t].pop() if t in by_id else 1))
        return ids, [m for m in media if m.kind not in self.raw]

    def build(self, prompt_ids: list[int], media: list[MediaEmbeds], tail: tuple[int, ...] = (),
              raw_expanded: bool = False, cache_salt: str = "") -> dict:
        """vLLM's prompt dict; ``tail``: completion tokens appended after the placeholders are
        counted (a generated token may equal a placeholder id); ``raw_expanded``: the raw kinds'
        placeholders are expanded already (:meth:`expand_raw`), no items of theirs given;
        ``cache_salt``: the request's cache scope ("": fleet-wide)."""
        by_kind: dict[str, list[MediaEmbeds]] = {}
        for item in media:
            by_kind.setdefault(getattr(item, "kind", "image"), []).append(item)
        other = sorted(set(by_kind) - self.modalities)
        if other:
            raise EngineError(f"the vllm engine serves {', '.join(sorted(self.modalities))} embeddings of "
                              f"{self.family} models, not {', '.join(other)}")
        for kind in sorted(self.modalities - (self.raw if raw_expanded else frozenset())):
            n_placeholders = sum(1 for t in prompt_ids if t == self.placeholders[kind])
            n_items = len(by_kind.get(kind, ()))
            if n_placeholders != n_items:
                raise EngineError(f"prompt has {n_placeholders} {kind} placeholders but {n_items} {kind} items given")
        prompt: dict = {"prompt_token_ids": [*prompt_ids, *(int(t) for t in tail)]}  # ids, not SampledToken
        if cache_salt:  # vLLM's prefix cache: blocks are shared only among prompts of the same salt
            prompt["cache_salt"] = cache_salt
        if not media:
            return prompt
        if len(media) > self.max_items:
            raise EngineError(f"{len(media)} media items exceed this engine's limit of {self.max_items} per prompt")
        data: dict = {}
        uuids: dict[str, list[str | None]] = {}
        for kind, items in by_kind.items():
            if kind in self.raw:
                data[kind] = self._raw_list(kind, items)
            else:
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
        out = {f"{kind}_embeds": torch.cat(embeds, dim=0).contiguous(),
               f"{kind}_grid_thw": torch.tensor(grids, dtype=torch.long)}
        if kind == "video" and self.family == "qwen2_5_vl":
            out["second_per_grid_ts"] = self._time_steps(items)
        return out

    @staticmethod
    def _time_steps(items: list[MediaEmbeds]) -> torch.Tensor:
        """Qwen2.5-VL videos' seconds per temporal patch: vLLM takes them beside the embeddings
        and steps each video's temporal M-RoPE axis by ``tokens_per_second`` times it; left out,
        vLLM would assume 1 s per patch, so a video without one is refused, never guessed."""
        steps = [float(getattr(it, "second_per_grid_t", 0.0)) for it in items]
        if min(steps) <= 0:
            raise EngineError("a Qwen2.5-VL video needs its second_per_grid_t (the processor's time step)")
        return torch.tensor(steps, dtype=torch.float32)

    def _raw_list(self, kind: str, items: list[MediaEmbeds]) -> list:
        """Images as PIL (what vLLM's processor gets from a decoded file), videos as uint8 frames."""
        from PIL import Image

        dims, form = (3, "[h, w, 3]") if kind == "image" else (4, "[frames, h, w, 3]")
        out = []
        for item in items:
            px = item[0]
            if px.dtype != torch.uint8 or px.dim() != dims or px.shape[-1] != 3:
                raise EngineError(f"vLLM takes {self.family} {kind}s as raw pixels (uint8 {form}), not "
                                  f"{px.dtype} {tuple(px.shape)}: {kind} embeddings cannot be served")
            arr = px.contiguous().numpy()
            out.append(Image.fromarray(arr) if kind == "image" else arr)
        return out

    @staticmethod
    def _plain_list(kind: str, items: list[MediaEmbeds]) -> list[torch.Tensor]:
        out = []
        for item in items:
            emb = item[0]
            if emb.dim() != 2 or emb.shape[0] < 1:
                raise EngineError(f"{kind} embedding of shape {tuple(emb.shape)} is not [n_tokens, hidden]")
            out.append(emb.to(torch.float32).contiguous())
        return out
