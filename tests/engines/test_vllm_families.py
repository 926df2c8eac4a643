"""VllmEngine on the families other than Qwen-VL, generating in one place (the epd layout):
LLaVA images and Qwen2-Audio clips from the transformers encoder's embeddings (as the encode
stage hands them), LLaVA-NeXT images and LLaVA-NeXT-Video videos as raw pixels (vLLM's own
processor and encoder: ``registry.ENGINE_RAW_MEDIA``); greedy tokens must equal one-process
``generate()``. The tiny builds load as they are (hub layout); the same weights in transformers
5's own layout are refused at start with the reason. One engine at a time (each start spawns a
vLLM engine core: ~15-30 s here). The fleets of these families: tests/e2e/test_vllm_families_fleet.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from shared.engines.base import EngineError, MediaEmbeds  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.engines.vllm_inputs import PromptBuilder  # noqa: E402
from shared.models.reference import load_reference, reference_generate  # noqa: E402
from shared.models.weight_layout import TRANSFORMERS5_LAYOUTS, rename_weights  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402
from tests.engines.test_vllm_engine import GREEDY, MAX_NEW_TOKENS, collect  # noqa: E402


def _tiny(family: str) -> Path:
    from shared.models.registry import DEMOS

    return DEMOS[family.replace("_", "-")](CACHE_DIR / "models")


@pytest.mark.parametrize("family", sorted(TRANSFORMERS5_LAYOUTS))
def test_transformers5_layout_is_refused_with_the_reason(family, tmp_path):
    """A fresh transformers-5 save's layout (the tiny build's weights renamed back to it)."""
    model_dir = _tiny(family)
    VllmEngine(model_dir)  # the build itself (hub layout) is taken
    copy = Path(shutil.copytree(model_dir, tmp_path / family))
    _marker, old, new = TRANSFORMERS5_LAYOUTS[family]
    rename_weights(copy, new, old)
    with pytest.raises(ValueError, match=f"cannot load this {family} checkpoint: it was saved in transformers 5"):
        VllmEngine(copy)


def test_raw_video_prompt_and_the_consumers_expansion():
    """LLaVA-NeXT-Video's videos go to vLLM as frames; embeddings of them are refused by name; a
    decode consumer's prompt has each video's placeholder expanded to its tokens, no media."""
    from transformers import AutoTokenizer

    from shared import protocol

    model_dir = _tiny("llava_next_video")
    prompts = PromptBuilder(model_dir, AutoTokenizer.from_pretrained(str(model_dir)), 4)
    assert prompts.raw == {"video"} and prompts.modalities == {"video"}
    vid = prompts.placeholders["video"]
    frames = torch.zeros(3, 64, 80, 3, dtype=torch.uint8)
    built = prompts.build([1, vid, 2], [MediaEmbeds(frames, (0, 0, 0), "video", mm_hash="h", n_tokens=48)])
    assert built["multi_modal_data"]["video"][0].shape == (3, 64, 80, 3)
    assert built["multi_modal_uuids"] == {"video": ["h"]}
    with pytest.raises(EngineError, match="as raw pixels .* video embeddings cannot be served"):
        prompts.build([1, vid, 2], [MediaEmbeds(torch.zeros(48, 128), (0, 0, 0), "video")])
    shapes = (protocol.MediaShape("video", (0, 0, 0), 48), protocol.MediaShape("video", (0, 0, 0), 16))
    ids, rest = prompts.expand_raw([1, vid, 2, vid], shapes)
    assert ids == [1, *[vid] * 48, 2, *[vid] * 16] and rest == []
    assert prompts.build(ids, rest, tail=(7,), raw_expanded=True) == {"prompt_token_ids": [*ids, 7]}
    with pytest.raises(EngineError, match="placeholders do not match"):
        prompts.expand_raw([1, vid], shapes)


async def run_parity(model_dir, cases: dict, encode=None) -> None:
    """cases: name → (messages, engine media items (inputs of ``encode``, or given as they are),
    reference kwargs); ``encode``: the transformers compute whose encoder makes the embeddings."""
    reference = load_reference(model_dir)
    expected, prompts = {}, {}
    for name, (msgs, items, ref_kw) in cases.items():
        expected[name] = reference_generate(model_dir, msgs, ref_kw.pop("images", []), MAX_NEW_TOKENS,
                                            loaded=reference, **ref_kw)
        assert len(set(expected[name])) > 1, f"{name}: degenerate model, one token repeated"
        if encode is not None:
            feats = encode.encode_media(items) if items else []
            items = [MediaEmbeds(f, p.grid_thw, p.kind, mm_hash=f"{name}-{i}")
                     for i, (f, p) in enumerate(zip(feats, items))]
        ids = (encode or _Renderer(model_dir)).render_prompt_ids(msgs)
        prompts[name] = (ids, items)
    engine = VllmEngine(model_dir, kv_cache_bytes=64 << 20)
    await engine.start()
    try:
        for name, (ids, media) in prompts.items():
            got = await collect(engine.generate(f"fam-{name}", ids, media, GREEDY))
            assert got == expected[name], name
    finally:
        await engine.stop()


class _Renderer:
    """The chat template's prompt ids without loading any weights (the raw-media family)."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoProcessor

        self._processor = AutoProcessor.from_pretrained(str(model_dir))

    def render_prompt_ids(self, msgs) -> list[int]:
        text = self._processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self._processor.tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_llava_images_match_generate():
    from shared.engines.llava import LlavaCompute
    from tests.unit.test_engine_llava import image, msgs

    model_dir = _tiny("llava")
    compute = LlavaCompute(model_dir)
    imgs = [image(1), image(2, (120, 80))]
    await run_parity(model_dir, {
        "text": (msgs(0), [], {}),
        "one_image": (msgs(1), [compute.preprocess_image(imgs[0])], {"images": imgs[:1]}),
        "two_images": (msgs(2), [compute.preprocess_image(i) for i in imgs], {"images": imgs}),
    }, encode=compute)


async def test_llava_next_raw_images_match_generate():
    """Raw: vLLM's LLaVA-NeXT takes image embeddings only as one fixed-shape batch, so two images
    of different tile counts (5 and 3 here) could not go as embeddings."""
    from shared.engines.llava import NextImagePreprocessor
    from tests.unit.test_engine_llava_next import SIZES, image, msgs

    model_dir = _tiny("llava_next")
    raw = NextImagePreprocessor(model_dir, raw=True)
    imgs = [image(i, size) for i, size in enumerate(SIZES[:2])]
    items = [raw(i) for i in imgs]
    assert items[0].pixel_values.shape == (60, 90, 3) and [it.n_tokens for it in items] == [70, 56]
    media = [MediaEmbeds(it.pixel_values, it.grid_thw, "image", mm_hash=f"i{i}", n_tokens=it.n_tokens)
             for i, it in enumerate(items)]
    await run_parity(model_dir, {
        "one_image": (msgs(1), media[:1], {"images": imgs[:1]}),
        "two_images": (msgs(2), media, {"images": imgs}),
    })


async def test_llava_next_video_raw_frames_match_generate():
    from shared.engines.llava import NextVideoPreprocessor
    from tests.unit.test_engine_llava import frames, vmsgs

    model_dir = _tiny("llava_next_video")
    raw = NextVideoPreprocessor(model_dir, raw=True)
    videos = [frames(i, n) for i, n in enumerate((4, 3))]  # vLLM's model takes one video per prompt
    items = [raw(v) for v in videos]
    assert items[0].pixel_values.dtype == torch.uint8 and [it.n_tokens for it in items] == [4 * 16, 3 * 16]
    media = [MediaEmbeds(it.pixel_values, it.grid_thw, "video", mm_hash=f"v{i}", n_tokens=it.n_tokens)
             for i, it in enumerate(items)]
    await run_parity(model_dir, {
        "four_frames": (vmsgs(1), media[:1], {"videos": videos[:1]}),
        "three_frames": (vmsgs(1), media[1:], {"videos": videos[1:]}),
    })


async def test_qwen2_audio_clips_match_generate():
    from shared.engines.qwen2_audio import Qwen2AudioCompute
    from tests.unit.test_engine_qwen2_audio import clip, msgs

    model_dir = _tiny("qwen2_audio")
    compute = Qwen2AudioCompute(model_dir)
    clips = [clip(440.0, 0.5), clip(2000.0, 1.5)]
    await run_parity(model_dir, {
        "one_clip": (msgs(1), [compute.preprocess_audio(clips[0])], {"audios": clips[:1]}),
        "two_clips": (msgs(2), [compute.preprocess_audio(c) for c in clips], {"audios": clips}),
    }, encode=compute)
