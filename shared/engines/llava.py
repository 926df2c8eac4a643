"""LLaVA split compute path (CLIP vision tower + projector, plain-position LM), with the same
interface as the other families' compute classes.

- ``preprocess_image`` (:class:`LlavaImagePreprocessor`): a PIL image → ``pixel_values``
  ``[3, S, S]`` and the LM token count ``(S / patch)²`` (+ 1 with the "full" feature strategy).
- ``encode_media`` runs ONE vision forward over any number of images (``get_image_features``);
  prefill and decode come from :class:`~shared.engines.plain_lm.PlainLMCompute`.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shared.engines.plain_lm import PlainLMCompute
from shared.engines.qwen2_vl import MediaPixels, _kind


def llava_image_tokens(config) -> int:
    vision = config.vision_config
    n = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return n + (1 if config.vision_feature_select_strategy == "full" else 0)


class LlavaImagePreprocessor:
    """The model's own image processor alone (no weights): what media-fetch runs."""

    def __init__(self, model_dir: Path | str, *, processor=None, config=None) -> None:
        from transformers import AutoConfig, AutoProcessor

        processor = processor or AutoProcessor.from_pretrained(str(model_dir))
        self._image_processor = processor.image_processor
        self._n_tokens = llava_image_tokens(config or AutoConfig.from_pretrained(str(model_dir)))

    @torch.inference_mode()
    def __call__(self, img: Image.Image) -> MediaPixels:
        out = self._image_processor(images=[img], return_tensors="pt")
        return MediaPixels(out["pixel_values"][0].to(torch.float32).contiguous(), (0, 0, 0), self._n_tokens)


class LlavaCompute(PlainLMCompute):
    kind = "image"

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "auto",
                 parts: frozenset[str] | None = None) -> None:
        from transformers import LlavaForConditionalGeneration

        self._load(LlavaForConditionalGeneration, model_dir, device, dtype, parts)
        self.placeholder_token_id: int = int(self.model.config.image_token_id)
        self._init_lm()
        self.preprocess_image = LlavaImagePreprocessor(self.model_dir, processor=self.processor,
                                                       config=self.model.config)

    @torch.inference_mode()
    def encode_media(self, items: list[MediaPixels]) -> list[torch.Tensor]:
        """One vision forward over every image; float32 ``[n_tokens, hidden]`` each."""
        if not items:
            return []
        if any(_kind(it) != "image" for it in items):
            raise ValueError(f"LLaVA encodes images, not {sorted({_kind(it) for it in items} - {'image'})}")
        cfg = self.model.config
        out = self.model.model.get_image_features(
            pixel_values=torch.stack([it.pixel_values for it in items]).to(self.device, self.dtype),
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True)
        result = [f.to(self.dtype).contiguous().clone() for f in out.pooler_output]
        for it, f in zip(items, result):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return result


class NextVideoPreprocessor:
    """LLaVA-NeXT-Video's own video processor alone (no weights): sampled frames
    (``uint8 [frames, h, w, 3]``) → ``pixel_values_videos`` ``[frames, 3, S, S]`` and the LM
    token count (frames · (S / patch)² / pool²). ``raw``: the frames themselves (uint8, as
    sampled) with that count, for an LM engine that takes raw video (``registry.raw_modalities``)."""

    def __init__(self, model_dir: Path | str, *, processor=None, config=None, raw: bool = False) -> None:
        from transformers import AutoConfig, AutoProcessor

        processor = processor or AutoProcessor.from_pretrained(str(model_dir))
        config = config or AutoConfig.from_pretrained(str(model_dir))
        self._video_processor = processor.video_processor
        vision = config.vision_config
        self._per_frame = (int(vision.image_size) // int(vision.patch_size) // int(config.spatial_pool_stride)) ** 2
        self._raw = raw

    @torch.inference_mode()
    def __call__(self, frames, fps: float = 0.0) -> MediaPixels:
        """``fps``: the rate the frames were sampled at (this family's positions do not use it)."""
        if self._raw:
            px = torch.from_numpy(np.ascontiguousarray(frames, dtype=np.uint8))
            return MediaPixels(px, (0, 0, 0), px.shape[0] * self._per_frame, "video")
        px = self._video_processor(videos=[frames], return_tensors="pt")["pixel_values_videos"][0]
        return MediaPixels(px.to(torch.float32).contiguous(), (0, 0, 0), px.shape[0] * self._per_frame, "video")


class LlavaNextVideoCompute(PlainLMCompute):
    """Videos only (the family's anyres image path is not served)."""

    kind = "video"

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "auto",
                 parts: frozenset[str] | None = None) -> None:
        from transformers import LlavaNextVideoForConditionalGeneration

        self._load(LlavaNextVideoForConditionalGeneration, model_dir, device, dtype, parts)
        self.placeholder_token_id: int = int(self.model.config.video_token_id)
        self._init_lm()
        self.preprocess_video = NextVideoPreprocessor(self.model_dir, processor=self.processor,
                                                      config=self.model.config)

    @torch.inference_mode()
    def encode_media(self, items: list[MediaPixels]) -> list[torch.Tensor]:
        """One vision forward over every frame of every video; float32 ``[n_tokens, hidden]``
        each, frame-major (the order ``forward`` scatters them in)."""
        if not items:
            return []
        if any(_kind(it) != "video" for it in items):
            raise ValueError(f"LLaVA-NeXT-Video encodes videos, not {sorted({_kind(it) for it in items} - {'video'})}")
        cfg = self.model.config
        frames = torch.cat([it.pixel_values for it in items])[None]  # [1, all frames, 3, S, S]
        (feats,) = self.model.model.get_video_features(
            pixel_values_videos=frames, vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True).pooler_output
        per_item = torch.split(feats, [it.pixel_values.shape[0] for it in items])
        result = [f.flatten(0, 1).to(self.dtype).contiguous().clone() for f in per_item]
        for it, f in zip(items, result):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return result


class NextImagePreprocessor:
    """LLaVA-NeXT's processor on one image (no weights): its "anyres" tiles ``pixel_values``
    ``[tiles, 3, S, S]``, ``meta = image_sizes`` (height, width: what the encoder unpads by) and
    the LM token count — all from the processor's own call on a one-placeholder text, so the
    count is the one ``processor(text, images)`` expands ``<image>`` to. ``raw``: the image itself
    (uint8 ``[h, w, 3]``) with that count, for an LM engine that takes raw images."""

    def __init__(self, model_dir: Path | str, *, processor=None, raw: bool = False) -> None:
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(model_dir))
        self._processor = processor
        self._image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        self._raw = raw

    @torch.inference_mode()
    def __call__(self, img: Image.Image) -> MediaPixels:
        out = self._processor(text=[self._processor.image_token], images=[img], return_tensors="pt")
        height, width = (int(x) for x in out["image_sizes"][0].tolist())
        n_tokens = int((out["input_ids"] == self._image_id).sum())
        if self._raw:
            return MediaPixels(torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()), (0, 0, 0),
                               n_tokens, "image", (height, width))
        return MediaPixels(out["pixel_values"][0].to(torch.float32).contiguous(), (0, 0, 0), n_tokens, "image",
                           (height, width))


class LlavaNextCompute(PlainLMCompute):
    """LLaVA-NeXT images: anyres tiles through the tower, packed (unpadded, ``image_newline``
    row ends) by the model's own ``get_image_features``."""

    kind = "image"

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "auto",
                 parts: frozenset[str] | None = None) -> None:
        from transformers import LlavaNextForConditionalGeneration

        self._load(LlavaNextForConditionalGeneration, model_dir, device, dtype, parts)
        self.placeholder_token_id: int = int(self.model.config.image_token_id)
        self._init_lm()
        self.preprocess_image = NextImagePreprocessor(self.model_dir, processor=self.processor)

    @torch.inference_mode()
    def encode_media(self, items: list[MediaPixels]) -> list[torch.Tensor]:
        """One tower forward over every tile of every image; ``[n_tokens, hidden]`` each."""
        if not items:
            return []
        if any(_kind(it) != "image" for it in items):
            raise ValueError(f"LLaVA-NeXT encodes images, not {sorted({_kind(it) for it in items} - {'image'})}")
        if any(len(it.meta) != 2 for it in items):
            raise ValueError("a LLaVA-NeXT image needs its image_sizes (height, width) in meta")
        cfg = self.model.config
        tiles = max(it.pixel_values.shape[0] for it in items)
        pixels = torch.zeros(len(items), tiles, *items[0].pixel_values.shape[1:], dtype=self.dtype, device=self.device)
        for i, it in enumerate(items):  # padded as the processor pads a batch; the model slices it back
            pixels[i, : it.pixel_values.shape[0]] = it.pixel_values.to(self.device, self.dtype)
        sizes = torch.tensor([list(it.meta) for it in items], dtype=torch.long, device=self.device)
        out = self.model.model.get_image_features(
            pixel_values=pixels, image_sizes=sizes, vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True)
        result = [f.to(self.dtype).contiguous().clone() for f in out.pooler_output]
        for it, f in zip(items, result):
            if f.shape != (it.n_tokens, self.hidden_size):
                raise RuntimeError(f"encoder output {tuple(f.shape)} != ({it.n_tokens}, {self.hidden_size})")
        return result
