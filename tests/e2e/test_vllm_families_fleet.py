"""LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video and Qwen2-Audio through a vLLM fleet, against vLLM's
own offline ``LLM.generate`` on the same checkpoint, prompt and media (``tests.vllm_offline``: the
bytes decoded as media-fetch decodes them, then vLLM's processor and encoder): the fleet's greedy
text must equal it, and a request with no sampling fields must get vLLM's answer under the
model's generation config (a copy with non-trivial defaults, ``vllm_checks.tuned_copy``). One
fleet per family serves all its cases. LLaVA and Qwen2-Audio go as our encoder's embeddings, in
e-p-d (the KV moved from prefill's vLLM to decode's); LLaVA-NeXT and LLaVA-NeXT-Video by the
raw-media path, in e-p-d (the decoded images cross from the encode worker to prefill's vLLM over
NIXL) and ep-d (the frames stay in the encode+prefill worker). The epd layout of each family is
covered at engine level (tests/engines/test_vllm_families.py). The reference runs while the
fleet starts.
"""

from __future__ import annotations

import base64
import importlib.util
import io

import numpy as np
import openai
import pytest
from PIL import Image

from shared.models.registry import DEMOS
from shared.settings import Settings
from tests import procs
from tests.conftest import CACHE_DIR
from tests.e2e.vllm_checks import GENERATION, tuned_copy
from tests.media import samples
from tests.vllm_offline import Case, start_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")

MAX_TOKENS = 8
MIME = {"image": "image/png", "video": "video/mp4"}


def _png(seed: int, size: tuple[int, int]) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _video(seed: int) -> bytes:
    return samples.video(samples.video_frames(16, size=(96, 64), seed=seed), fps=8)


def _wav(freq: float, seconds: float) -> bytes:
    return samples.wav(seconds, rate=44_100, freq=freq)


# family -> (mode, case -> (media items (kind, bytes, num_frames), question))
FAMILIES = {
    "llava": ("e-p-d", {
        "text": ([], "Say something."),
        "one_image": ([("image", _png(1, (90, 60)), 0)], "What is in the image?"),
        "two_images": ([("image", _png(2, (60, 90)), 0), ("image", _png(3, (120, 80)), 0)], "Compare them."),
    }),
    "llava_next": ("e-p-d", {  # 5 and 3 anyres tiles
        "one_image": ([("image", _png(1, (90, 60)), 0)], "What is in the image?"),
        "two_images": ([("image", _png(2, (200, 200)), 0), ("image", _png(3, (60, 130)), 0)], "Compare them."),
    }),
    "llava_next_video": ("ep-d", {
        "default_frames": ([("video", _video(5), 0)], "What happens in the video?"),
        "three_frames": ([("video", _video(6), 3)], "What happens?"),
    }),
    "qwen2_audio": ("e-p-d", {
        "one_clip": ([("audio", _wav(440.0, 0.5), 0)], "What is this sound?"),
        "two_clips": ([("audio", _wav(2000.0, 1.5), 0), ("audio", _wav(300.0, 1.0), 0)], "Which is higher?"),
    }),
}


def _openai_part(kind: str, raw: bytes, num_frames: int) -> dict:
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}}
    url = {"url": f"data:{MIME[kind]};base64," + base64.b64encode(raw).decode()}
    if num_frames:
        url["num_frames"] = num_frames
    return {"type": f"{kind}_url", f"{kind}_url": url}


def _decoded(kind: str, raw: bytes, num_frames: int, s: Settings):
    """One item as media-fetch decodes it under the default settings, in vLLM's raw-media form."""
    from shared.media.audio import decode_audio
    from shared.media.images import decode_image
    from shared.media.video import VideoLimits, decode_video_clip

    if kind == "image":
        return decode_image(raw, max_pixels=s.max_image_pixels, param="p")
    if kind == "video":
        limits = VideoLimits(max_duration_s=s.max_video_duration_s, max_frames=s.max_video_frames,
                             max_side=s.max_video_side, max_decoded_frames=s.max_video_decoded_frames,
                             max_pixels=s.max_video_pixels)
        fps = 0.0 if num_frames else s.video_fps
        frames = decode_video_clip(raw, num_frames=num_frames or (0 if fps else s.video_num_frames), fps=fps,
                                   limits=limits, param="p").frames
        return frames, None  # LLaVA-NeXT-Video takes the frames alone
    return decode_audio(raw, rate_hz=16_000, max_duration_s=s.max_audio_duration_s, param="p"), 16_000


def _reference_cases(cases: dict) -> dict[str, Case]:
    """Each case greedy, and the first one again as ``defaults``: no sampling fields at all."""
    s = Settings()
    out = {}
    for name, (items, question) in cases.items():
        by_kind: dict[str, list] = {"image": [], "video": [], "audio": []}
        for kind, raw, num_frames in items:
            by_kind[kind].append(_decoded(kind, raw, num_frames, s))
        out[name] = Case(question, by_kind["image"], by_kind["video"], by_kind["audio"], max_tokens=MAX_TOKENS)
    first = next(iter(out.values()))
    out["defaults"] = Case(first["text"], first["images"], first["videos"], first["audios"])
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fleet_equals_vllm_offline(family, kafka_bootstrap, redis_url, tmp_path):
    mode, cases = FAMILIES[family]
    model_dir = tuned_copy(DEMOS[family.replace("_", "-")](CACHE_DIR / "models"), tmp_path / "model")
    reference = start_offline(model_dir, _reference_cases(cases), tmp_path / "offline")  # while the fleet starts
    try:
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_ENGINE": "vllm", "MMFLEET_REDIS_PREFIX": f"vllm-{family}",
               "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024)}
        answers = {}
        (tmp_path / "fleet").mkdir()
        with procs.fleet(env, tmp_path / "fleet", mode=mode, ready_timeout_s=300) as (base, _proc):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            for name, (items, question) in cases.items():
                kwargs = dict(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS, messages=[
                    {"role": "user", "content": [*(_openai_part(*it) for it in items),
                                                 {"type": "text", "text": question}]}])
                answers[name] = client.chat.completions.create(**kwargs).choices[0].message.content
                if name == next(iter(cases)):
                    answers[name + " (stream)"] = "".join(
                        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                        if c.choices)
            items, question = next(iter(cases.values()))  # no sampling fields: the generation config's defaults
            content = [*(_openai_part(*it) for it in items), {"type": "text", "text": question}]
            out = client.chat.completions.create(model="mmfleet-demo", messages=[{"role": "user", "content": content}])
            defaults = (out.choices[0].message.content, out.usage.completion_tokens, out.choices[0].finish_reason)
            if family == "llava_next_video":  # vLLM's model takes one video per prompt: a 400, as vllm serve's
                items, question = cases["default_frames"]
                with pytest.raises(openai.BadRequestError, match="2 video items; this server takes at most 1"):
                    client.chat.completions.create(model="mmfleet-demo", max_tokens=2, messages=[
                        {"role": "user", "content": [*(_openai_part(*it) for it in items * 2),
                                                     {"type": "text", "text": question}]}])
        offline = reference.answers()
        expected = {name: a["text"] for name, a in offline.items()}
        offline_defaults = offline["defaults"]
    finally:
        reference.kill()
    del expected["defaults"]
    assert (offline_defaults["finish_reason"], len(offline_defaults["token_ids"])) == \
        ("length", GENERATION["max_new_tokens"]), f"vLLM did not take the generation config: {offline_defaults}"
    # the same tokens: vLLM's ids decoded whole, as the gateway decodes a completion (vLLM's own
    # text leaves out a byte-level token's partial UTF-8 at a length cut; the gateway keeps it as U+FFFD)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(model_dir).decode(offline_defaults["token_ids"], skip_special_tokens=True)
    assert defaults == (text, len(offline_defaults["token_ids"]), offline_defaults["finish_reason"]), \
        f"{family}: no sampling fields"
    assert len(set(expected.values())) > 1, f"{family}: degenerate model, every case answered alike"
    assert answers == {**expected, **{k + " (stream)": expected[k] for k in list(cases)[:1]}}
