"""Qwen2-VL split compute path (:class:`Qwen2VLCompute`): encode, prefill and decode as separate
pure steps. Pure and synchronous (no I/O beyond loading the model dir, no global state;
``model.model.rope_deltas`` is never used: positions are always passed), called from a worker
thread. ``encode_media`` runs ONE vision forward over any number of images; ``prefill`` expands
placeholders, computes M-RoPE positions and returns the last logits, the packed KV and
``rope_delta``; ``start_decode`` / ``decode_step`` continue from a packed KV on any instance.
Preprocessors produce exactly what ``AutoProcessor`` would (the same processor object).

Design: docs/guide/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from shared.engines import cpu_attention
from shared.engines.kv_pack import pack_kv, unpack_kv


@dataclass(frozen=True)
class MediaPixels:
    """Processor output for one image (or video: ``kind="video"``).

    pixel_values: float32 [n_patches, patch_dim] (patch_dim = C·t_patch·p·p).
    grid_thw: (t, h, w) in patches.  n_tokens = t·h·w / merge² (LM image tokens).
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    n_tokens: int
    kind: str = "image"
    meta: tuple[int, ...] = ()  # family-specific geometry (Qwen2-Audio: valid feature frames)
    second_per_grid_t: float = 0.0  # Qwen2.5-VL videos: seconds one temporal patch spans


@dataclass(frozen=True)
class PrefillResult:
    """Prefill output.  ``kv``: contiguous float32 [n_layers, 2, n_kv_heads, prompt_len, head_dim]
    (index 0 = keys, 1 = values); ``prompt_len`` counts expanded image tokens;
    ``rope_delta`` = max M-RoPE position + 1 − prompt_len (0 for text-only)."""

    last_logits: torch.Tensor
    kv: torch.Tensor
    rope_delta: int
    prompt_len: int


@dataclass
class DecodeState:
    """Per-sequence decode state owned by one caller; not shared between threads."""

    cache: object  # transformers DynamicCache
    rope_delta: int
    seq_len: int


class ImagePreprocessor:
    """The model's own image processor alone (no weights): what media-fetch runs.

    Loaded through ``AutoProcessor`` so it is the very processor class and backend that the
    reference (``AutoProcessor`` + ``generate``) uses.
    """

    def __init__(self, model_dir: Path | str, *, processor=None) -> None:
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(model_dir))
        self._image_processor = processor.image_processor
        self._merge = int(self._image_processor.merge_size)

    @property
    def pixel_bounds(self) -> tuple[int, int]:
        """(min, max) pixels an image is resized into by default."""
        size = self._image_processor.size
        return int(size["shortest_edge"]), int(size["longest_edge"])

    @property
    def token_pixels(self) -> int:
        """Pixels one image token covers, (patch · merge)² (Qwen2-VL: 28²)."""
        return (int(self._image_processor.patch_size) * self._merge) ** 2

    @torch.inference_mode()
    def __call__(self, img: Image.Image, min_pixels: int = 0, max_pixels: int = 0) -> MediaPixels:
        """``min_pixels`` / ``max_pixels`` (0: the processor's own): the request's pixel budget."""
        kw = {}
        if min_pixels or max_pixels:
            lo, hi = self.pixel_bounds
            kw["size"] = {"shortest_edge": min_pixels or min(lo, max_pixels), "longest_edge": max_pixels or hi}
        out = self._image_processor(images=[img], return_tensors="pt", **kw)
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        n_tokens = grid[0] * grid[1] * grid[2] // (self._merge**2)
        return MediaPixels(out["pixel_values"].to(torch.float32).contiguous(), grid, n_tokens)


class VideoPreprocessor:
    """The model's own video processor alone (no weights): what media-fetch runs on sampled
    frames (``uint8 [frames, h, w, 3]``). Output as :class:`MediaPixels` (``pixel_values`` are
    ``pixel_values_videos``, ``grid_thw`` is ``video_grid_thw``), exactly what ``AutoProcessor``
    gives for ``videos=[frames]``."""

    def __init__(self, model_dir: Path | str, *, processor=None) -> None:
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(model_dir))
        self._video_processor = processor.video_processor
        self._merge = int(self._video_processor.merge_size)

    @torch.inference_mode()
    def __call__(self, frames, fps: float = 0.0) -> MediaPixels:
        """``fps``: the rate the frames were sampled at (Qwen2-VL's positions do not use it)."""
        out = self._video_processor(videos=[frames], return_tensors="pt")
        grid = tuple(int(x) for x in out["video_grid_thw"][0].tolist())
        n_tokens = grid[0] * grid[1] * grid[2] // (self._merge**2)
        return MediaPixels(out["pixel_values_videos"].to(torch.float32).contiguous(), grid, n_tokens)


def _kind(item) -> str:
    """An item's modality: ``MediaEmbeds`` / ``MediaPixels`` carry one; plain tuples are images."""
    return getattr(item, "kind", "image")


class Qwen2VLCompute:
    """Loads a Qwen2-VL model dir once; methods are safe to call from one thread at a time
    per state object (the model itself is only read).

    The model runs on ``placement`` (settings ``device`` / ``dtype``; float32 on CPU by default);
    inputs may come from any device, encoder outputs and KV stay on the compute device in the
    model dtype, logits come back as float32 on the CPU (sampling runs there)."""

    supports_prefix_kv = True  # prefill(prefix_kv=...) computes only the rest of the prompt
    mrope = True  # decode positions: cache_len + rope_delta on three axes (shared.engines.batched)
    model_class = "Qwen2VLForConditionalGeneration"
    video_preprocessor_class = VideoPreprocessor

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "auto",
                 parts: frozenset[str] | None = None) -> None:
        import transformers
        from transformers import AutoProcessor

        from shared.models.loading import ALL_PARTS, checkpoint_dtype, load_parts
        from shared.process.device import resolve_placement

        self.model_dir = Path(model_dir)
        self.placement = resolve_placement(device, dtype, checkpoint_dtype(self.model_dir))
        self.device, self.dtype = self.placement.device, self.placement.dtype
        self.processor = AutoProcessor.from_pretrained(str(self.model_dir))
        # parts: the encoder and / or the LM (shared.models.loading); None: both
        self.model = load_parts(getattr(transformers, self.model_class), self.model_dir, self.placement,
                                ALL_PARTS if parts is None else parts)
        cfg = self.model.config
        cpu_attention.install(self.model, cfg.text_config)  # prefix hits without a mask, no K/V copies
        self.placeholder_token_id: int = int(cfg.image_token_id)
        self.video_token_id: int = int(cfg.video_token_id)
        # modality -> (placeholder token id, mm_token_type id get_rope_index expects)
        self._placeholder = {"image": (self.placeholder_token_id, 1), "video": (self.video_token_id, 2)}
        self.hidden_size: int = int(cfg.text_config.hidden_size)
        self.merge_size: int = int(cfg.vision_config.spatial_merge_size)
        text_cfg = cfg.text_config
        self.n_layers: int = int(text_cfg.num_hidden_layers)
        self.n_kv_heads: int = int(text_cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(text_cfg, "head_dim", None)
                                 or text_cfg.hidden_size // text_cfg.num_attention_heads)
        self.eos_token_ids: frozenset[int] = self._eos_ids()
        self.max_model_len: int = int(text_cfg.max_position_embeddings)
        self.cache_config = self.model.config  # what DynamicCache is built with for this model
        self.preprocess_image = ImagePreprocessor(self.model_dir, processor=self.processor)
        self.preprocess_video = self.video_preprocessor_class(self.model_dir, processor=self.processor)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def _eos_ids(self) -> frozenset[int]:
        # generate() stops on generation_config's eos list; mirror it exactly.
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.text_config.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        return frozenset(int(i) for i in ids)

    # ---- prompt helpers -------------------------------------------------------

    def render_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Chat template → token ids with ONE placeholder per image (unexpanded)."""
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- encode ---------------------------------------------------------------

    @torch.inference_mode()
    def encode_media(self, items: list[MediaPixels]) -> list[torch.Tensor]:
        """One vision forward per modality present (images, videos) over all items; returns
        [n_tokens, hidden] per item (model dtype, on the compute device), in the order given."""
        result: list[torch.Tensor | None] = [None] * len(items)
        for kind in ("image", "video"):
            idx = [i for i, it in enumerate(items) if _kind(it) == kind]
            if not idx:
                continue
            pixel_values = torch.cat([items[i].pixel_values for i in idx], dim=0).to(self.device, self.dtype)
            grid_thw = torch.tensor([items[i].grid_thw for i in idx], dtype=torch.long, device=self.device)
            features = self.model.model.get_image_features if kind == "image" else self.model.model.get_video_features
            feats = features(pixel_values, grid_thw, return_dict=True).pooler_output  # split per item
            # clone: the splits are views of one batch tensor; an item shipped or cached on
            # its own must not keep the whole batch's storage alive.
            for i, f in zip(idx, feats, strict=True):
                result[i] = f.to(self.dtype).contiguous().clone()
        unknown = sorted({_kind(it) for it in items} - {"image", "video"})
        if unknown:
            raise ValueError(f"Qwen2-VL encodes images and videos, not {', '.join(unknown)}")
        for it, f in zip(items, result):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return result

    # ---- prefill --------------------------------------------------------------

    def expand_prompt(self, prompt_ids: list[int], media: list) -> list[int]:
        """Replace the i-th placeholder (image or video token) by items[i]'s token count of it.

        ``media``: ``(embeds, grid_thw[, kind])`` per item in prompt order (``MediaEmbeds``).
        Raises ValueError when the placeholders differ from the items (count or modality, in
        order) or an embedding's row count disagrees with t·h·w/merge².
        """
        ids_of = {tok: kind for kind, (tok, _) in self._placeholder.items()}
        found = [ids_of[t] for t in prompt_ids if t in ids_of]
        kinds = [_kind(it) for it in media]
        if found != kinds:
            raise ValueError(f"prompt has placeholders {found} but items {kinds} given")
        expanded: list[int] = []
        it = iter(media)
        for tok in prompt_ids:
            if tok not in ids_of:
                expanded.append(tok)
                continue
            item = next(it)
            embeds, (t, h, w) = item[0], item[1]
            n = t * h * w // (self.merge_size**2)
            if embeds.shape[0] != n:
                raise ValueError(f"{ids_of[tok]} embedding has {embeds.shape[0]} rows, grid {(t, h, w)} needs {n}")
            expanded.extend([tok] * n)
        return expanded

    @torch.inference_mode()
    def prefill_inputs(self, prompt_ids: list[int], media: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The LM's inputs for a prompt: embeddings ``[L, hidden]`` with the media merged at the
        placeholders, position ids ``[4, 1, L]`` (row 0 plain text positions, used only for mask
        construction; rows 1..3 the M-RoPE axes: the layout generate() passes) and ``rope_delta``."""
        expanded = self.expand_prompt(prompt_ids, media)
        dev = self.device
        input_ids = torch.tensor([expanded], dtype=torch.long, device=dev)
        seq_len = input_ids.shape[1]
        token_type = torch.zeros_like(input_ids, dtype=torch.int)
        for tok, type_id in self._placeholder.values():
            token_type[input_ids == tok] = type_id
        is_media = token_type > 0

        if media:
            grids = {kind: [it[1] for it in media if _kind(it) == kind] for kind in ("image", "video")}
            vision_pos, _ = self.model.model.get_rope_index(
                input_ids, mm_token_type_ids=token_type,
                image_grid_thw=torch.tensor(grids["image"], dtype=torch.long, device=dev) if grids["image"] else None,
                video_grid_thw=torch.tensor(grids["video"], dtype=torch.long, device=dev) if grids["video"] else None,
                **self._rope_extra([it for it in media if _kind(it) == "video"]),
            )
            # decode continues from the last prompt token's position, as generate() does; that is
            # get_rope_index's own delta (the largest position + 1) unless a Qwen2.5-VL video's time
            # axis runs past the text after it (a clip sampled slower than the processor's 24 fps)
            rope_delta = int(vision_pos[:, 0, -1].max().item()) + 1 - seq_len
        else:
            vision_pos = torch.arange(seq_len, device=dev).view(1, 1, -1).expand(3, 1, -1)
            rope_delta = 0
        text_pos = torch.arange(seq_len, device=dev).view(1, 1, -1)
        position_ids = torch.cat([text_pos, vision_pos], dim=0)

        embeds = self.model.get_input_embeddings()(input_ids)
        if media:  # items are in prompt order, so one scatter over every media position
            media_embeds = torch.cat([it[0].to(dev, embeds.dtype) for it in media], dim=0)
            embeds = embeds.masked_scatter(is_media.unsqueeze(-1), media_embeds)
        return embeds[0], position_ids, rope_delta

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.cache_config)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], media: list, prefix_kv: torch.Tensor | None = None) -> PrefillResult:
        """Run the LM over the prompt with image / video embeddings merged at the placeholders.

        ``prefix_kv``: packed KV of the prompt's first ``P < prompt_len`` expanded positions
        (from an earlier prompt with the same prefix, see :mod:`shared.kv`); only positions
        ``P..`` are computed, with their M-RoPE positions taken from the whole prompt (a media
        item's positions depend only on what precedes it and on its grid), and the returned
        KV covers the whole prompt. Several fresh prompts at once: :mod:`shared.engines.batched_prefill`.
        """
        embeds, position_ids, rope_delta = self.prefill_inputs(prompt_ids, media)
        seq_len = embeds.shape[0]
        start = 0
        if prefix_kv is not None and prefix_kv.shape[3] > 0:
            start = int(prefix_kv.shape[3])
            if start >= seq_len:
                raise ValueError(f"prefix of {start} positions leaves nothing to compute of {seq_len}")
            cache = self.start_decode(prefix_kv, 0, start).cache
        else:
            cache = self.new_cache()
        out = self.model(
            inputs_embeds=embeds[None, start:],
            position_ids=position_ids[:, :, start:],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv = pack_kv(out.past_key_values)
        return PrefillResult(
            last_logits=out.logits[0, -1].to("cpu", torch.float32),
            kv=kv,
            rope_delta=rope_delta,
            prompt_len=seq_len,
        )

    def _rope_extra(self, videos: list) -> dict:
        """Family-specific ``get_rope_index`` arguments (Qwen2.5-VL: the videos' time steps)."""
        return {}

    # ---- decode ---------------------------------------------------------------

    @torch.inference_mode()
    def start_decode(self, kv_packed: torch.Tensor, rope_delta: int, seq_len: int) -> DecodeState:
        """Rebuild a DynamicCache from a packed KV (copied; the caller keeps its buffer)."""
        cache = unpack_kv(kv_packed, (self.n_layers, 2, self.n_kv_heads, seq_len, self.head_dim), self.model.config,
                          device=self.device, dtype=self.dtype)
        return DecodeState(cache=cache, rope_delta=int(rope_delta), seq_len=seq_len)

    @torch.inference_mode()
    def decode_step(self, state: DecodeState, token_id: int) -> torch.Tensor:
        """Append ``token_id`` and return next-token logits, float32 [vocab]. Positions are
        ``cache_len + rope_delta`` on all three M-RoPE axes; transformers 5.19's Qwen2-VL forward
        takes no ``cache_position``, the cache length is what places the new token."""
        cache_len = state.cache.get_seq_length()
        # M-RoPE for generated text: all three axes advance together, offset by rope_delta.
        dev = self.device
        mrope = torch.full((3, 1, 1), cache_len + state.rope_delta, dtype=torch.long, device=dev)
        text = torch.full((1, 1, 1), cache_len, dtype=torch.long, device=dev)
        out = self.model(
            input_ids=torch.tensor([[token_id]], dtype=torch.long, device=dev),
            position_ids=torch.cat([text, mrope], dim=0),
            past_key_values=state.cache,
            use_cache=True,
        )
        state.seq_len = cache_len + 1
        return out.logits[0, -1].to("cpu", torch.float32)
