"""vLLM's own offline answer for chat requests, the reference a vLLM fleet must equal: run as
``python -m tests.e2e.vllm_offline SPEC OUT`` (a subprocess: vLLM's engine core is spawned and
pinned, and must not outlive a test). SPEC (JSON): ``model``, ``max_tokens``, ``cases``: name →
``messages`` (OpenAI chat messages whose media parts name files: ``{"type": "image" | "video" |
"audio", "path": ..., "num_frames": n}``). Each item's bytes are decoded as media-fetch decodes
them (the server's default limits and sampling) and given to ``vllm.LLM.generate`` as raw media
(PIL image, uint8 frames, samples at the model's rate); the prompt is the model's chat template,
as ``vllm serve`` renders it. OUT gets name → the completion's text. Greedy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _media(part: dict, settings):
    from shared.media.audio import decode_audio
    from shared.media.images import decode_image
    from shared.media.video import VideoLimits, decode_video_clip

    raw = Path(part["path"]).read_bytes()
    if part["type"] == "image":
        return decode_image(raw, max_pixels=settings.max_image_pixels, param="p")
    if part["type"] == "video":
        limits = VideoLimits(max_duration_s=settings.max_video_duration_s, max_frames=settings.max_video_frames,
                             max_side=settings.max_video_side, max_decoded_frames=settings.max_video_decoded_frames,
                             max_pixels=settings.max_video_pixels)
        num_frames = int(part.get("num_frames") or 0)
        fps = 0.0 if num_frames else settings.video_fps
        return decode_video_clip(raw, num_frames=num_frames or (0 if fps else settings.video_num_frames), fps=fps,
                                 limits=limits, param="p").frames
    samples = decode_audio(raw, rate_hz=16_000, max_duration_s=settings.max_audio_duration_s, param="p")
    return (samples, 16_000)


def main(spec_path: str, out_path: str) -> None:
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from shared.settings import Settings

    spec = json.loads(Path(spec_path).read_text())
    settings = Settings()
    processor = AutoProcessor.from_pretrained(spec["model"])
    prompts, counts = [], {}
    for messages in spec["cases"].values():
        data: dict[str, list] = {}
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part["type"] != "text":
                    data.setdefault(part["type"], []).append(_media(part, settings))
        for kind, items in data.items():
            counts[kind] = max(counts.get(kind, 0), len(items))
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = {"prompt_token_ids": processor.tokenizer(text, add_special_tokens=False)["input_ids"]}
        if data:
            prompt["multi_modal_data"] = data
        prompts.append(prompt)
    llm = LLM(model=spec["model"], dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              limit_mm_per_prompt=counts or None, disable_log_stats=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"])))
    Path(out_path).write_text(json.dumps({name: out.outputs[0].text for name, out in zip(spec["cases"], outs)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
