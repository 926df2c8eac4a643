"""One-process transformers reference: what a plain transformers user would run.

This is the correctness anchor for every split mode: for greedy decoding the fleet must produce
exactly these tokens. Kept deliberately naive (processor on the chat-template text, then
``model.generate``) so it shares no code with the split compute path it checks.

Design: docs/guide/modes-and-engines.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image


def load_reference(model_dir: Path, *, device: str = "cpu", dtype: str = "auto"):
    """Return ``(processor, model)`` loaded from ``model_dir`` (eval; float32 on CPU, settings
    ``device`` / ``dtype`` otherwise); the model class follows the family (``model_type``)."""
    import transformers
    from transformers import AutoProcessor

    from shared.models.registry import family_of

    cls = getattr(transformers, _MODEL_CLASS[family_of(model_dir).name])
    processor = AutoProcessor.from_pretrained(str(model_dir))
    from shared.models.loading import checkpoint_dtype, load_parts
    from shared.process.device import resolve_placement

    model = load_parts(cls, model_dir, resolve_placement(device, dtype, checkpoint_dtype(model_dir)))
    return processor, model


_MODEL_CLASS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen2_audio": "Qwen2AudioForConditionalGeneration",
                "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                "llava_next_video": "LlavaNextVideoForConditionalGeneration"}


def reference_generate(
    model_dir: Path | str,
    messages: list[dict],
    images: list[Image.Image],
    max_new_tokens: int,
    *,
    loaded: tuple | None = None,
    videos: list | None = None,
    audios: list | None = None,
    video_fps: list[float] | None = None,
) -> list[int]:
    """Greedy-generate with ``model.generate`` and return only the new token ids.

    ``images`` are in the order their placeholders appear in ``messages``.  The
    output stops after the first eos (included, as ``generate`` returns it) or after
    ``max_new_tokens``.  ``loaded`` may pass a cached ``load_reference`` result to
    skip reloading; it does not change the result. ``videos``: sampled frames
    (``uint8 [frames, h, w, 3]``) per video placeholder, in order. ``audios``: float32
    mono samples at the feature extractor's rate per audio placeholder. ``video_fps``: the rate
    each video's frames were sampled at (Qwen2.5-VL's time positions; None: the processor's default).
    """
    processor, model = loaded if loaded is not None else load_reference(Path(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    extra = {}
    if videos:
        extra["videos"] = videos
    if video_fps:
        from transformers.video_utils import VideoMetadata

        extra["video_metadata"] = [VideoMetadata(total_num_frames=len(v), fps=fps, frames_indices=list(range(len(v))))
                                   for v, fps in zip(videos, video_fps, strict=True)]
    if audios:
        extra.update(audio=audios, sampling_rate=processor.feature_extractor.sampling_rate)
    inputs = processor(text=[text], images=images or None, return_tensors="pt", **extra).to(model.device)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    prompt_len = inputs["input_ids"].shape[1]
    return out[0, prompt_len:].tolist()
