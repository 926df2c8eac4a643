"""Qwen2.5-VL on the Qwen2-VL split compute path (:mod:`shared.engines.qwen2_vl`): the same
encode / prefill / decode steps and M-RoPE hand-off, with the family's own rules. The vision
tower (window attention) runs inside ``get_image_features`` / ``get_video_features``. Video
positions: the temporal M-RoPE axis advances by ``tokens_per_second · second_per_grid_t`` per
temporal patch; :class:`VideoPreprocessor` takes ``second_per_grid_t`` from the processor, told
the rate the clip's frames were sampled at (not its default 24 fps); it travels with the item
(``protocol.PixelItem.second_per_grid_t``) to prefill's ``get_rope_index``, and a video without
one is refused, never guessed.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engines.qwen2_vl import MediaPixels, Qwen2VLCompute


class VideoPreprocessor:
    """Qwen2.5-VL's processor on one video's sampled frames (``uint8 [frames, h, w, 3]``):
    ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts`` exactly as
    ``processor(text=..., videos=[frames])`` gives them (no weights)."""

    def __init__(self, model_dir: Path | str, *, processor=None) -> None:
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(model_dir))
        self._processor = processor
        self._merge = int(processor.video_processor.merge_size)

    @torch.inference_mode()
    def __call__(self, frames, fps: float = 0.0) -> MediaPixels:
        """``fps``: the rate the frames were sampled at, so one temporal patch spans the clip's own
        seconds (0: the processor's default rate, right only for frames taken at it)."""
        # one video placeholder as text: the processor's own call, so its time step is the one
        # the generate() reference gets with the same metadata
        kw = {"video_metadata": [video_metadata(len(frames), fps)]} if fps > 0 else {}
        out = self._processor(text=[self._processor.video_token], videos=[frames], return_tensors="pt", **kw)
        grid = tuple(int(x) for x in out["video_grid_thw"][0].tolist())
        n_tokens = grid[0] * grid[1] * grid[2] // (self._merge**2)
        step = float(torch.as_tensor(out["second_per_grid_ts"])[0])
        return MediaPixels(out["pixel_values_videos"].to(torch.float32).contiguous(), grid, n_tokens, "video",
                           second_per_grid_t=step)


def video_metadata(n_frames: int, fps: float):
    """transformers' description of ``n_frames`` frames sampled at ``fps``: its ``sampled_fps``
    is ``fps``, which sets ``second_per_grid_ts`` = temporal patch / fps."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=n_frames, fps=fps, frames_indices=list(range(n_frames)))


class Qwen2_5_VLCompute(Qwen2VLCompute):
    model_class = "Qwen2_5_VLForConditionalGeneration"
    video_preprocessor_class = VideoPreprocessor

    def _rope_extra(self, videos: list) -> dict:
        if not videos:
            return {}
        steps = [float(getattr(v, "second_per_grid_t", 0.0)) for v in videos]
        if min(steps) <= 0:
            raise ValueError("a Qwen2.5-VL video needs its second_per_grid_t (the processor's time step)")
        return {"second_per_grid_ts": torch.tensor(steps, device=self.device)}
