"""VllmEngine on the other families it serves from embeddings (shared.engines.vllm_inputs):
LLaVA images and Qwen2-Audio clips, encoded by the transformers encoder as the encode stage
does; greedy tokens must equal one-process ``generate()``. One engine at a time (each start
spawns a vLLM engine core: ~15-30 s here). Qwen2-VL video is in test_vllm_engine.py (its
engine); LLaVA-NeXT-Video is refused (tested without an engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from shared.engines.base import MediaEmbeds  # noqa: E402
from shared.engines.vllm_engine import VllmEngine  # noqa: E402
from shared.engines.vllm_inputs import TRANSFORMERS5_LAYOUTS  # noqa: E402
from shared.models.reference import load_reference, reference_generate  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402
from tests.engines.test_vllm_engine import GREEDY, MAX_NEW_TOKENS, collect  # noqa: E402


def test_llava_next_video_is_refused_with_the_reason():
    from shared.models.llava_next_video_tiny import ensure_tiny_llava_next_video

    with pytest.raises(ValueError, match="takes raw frames"):
        VllmEngine(ensure_tiny_llava_next_video(CACHE_DIR / "models"))


async def run_parity(model_dir, compute, cases: dict, engine_dir: Path | None = None) -> None:
    """cases: name → (messages, encoder inputs (MediaPixels), reference kwargs); the engine
    loads ``engine_dir`` (default ``model_dir``)."""
    reference = load_reference(model_dir)
    expected, prompts = {}, {}
    for name, (msgs, pixels, ref_kw) in cases.items():
        expected[name] = reference_generate(model_dir, msgs, ref_kw.pop("images", []), MAX_NEW_TOKENS,
                                            loaded=reference, **ref_kw)
        assert len(set(expected[name])) > 1, f"{name}: degenerate model, one token repeated"
        feats = compute.encode_media(pixels) if pixels else []
        media = [MediaEmbeds(f, p.grid_thw, p.kind, mm_hash=f"{name}-{i}")
                 for i, (f, p) in enumerate(zip(feats, pixels))]
        prompts[name] = (compute.render_prompt_ids(msgs), media)
    engine = VllmEngine(engine_dir or model_dir, kv_cache_bytes=64 << 20)
    await engine.start()
    try:
        for name, (ids, media) in prompts.items():
            got = await collect(engine.generate(f"fam-{name}", ids, media, GREEDY))
            assert got == expected[name], name
    finally:
        await engine.stop()


def hub_layout_copy(model_dir: Path, out: Path) -> Path:
    """The same weights renamed from transformers 5's layout to the hub's (the layout vLLM
    loads, ``vllm_inputs.TRANSFORMERS5_LAYOUTS``); every other file linked."""
    from safetensors.torch import load_file, save_file

    from shared.models.registry import family_of

    _marker, old, new = TRANSFORMERS5_LAYOUTS[family_of(model_dir).name]
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).symlink_to(f.resolve())
            continue
        tensors = load_file(str(f))
        save_file({new + k[len(old):] if k.startswith(old) else k: v for k, v in tensors.items()},
                  str(out / f.name), metadata={"format": "pt"})
    return out


async def test_llava_images_match_generate(tmp_path):
    """The tiny build (saved by transformers 5) is refused with the reason; the same weights in
    the hub's layout serve images with ``generate()``'s tokens (as for the audio test)."""
    from shared.engines.llava import LlavaCompute
    from shared.models.llava_tiny import ensure_tiny_llava
    from tests.unit.test_engine_llava import image, msgs

    model_dir = ensure_tiny_llava(CACHE_DIR / "models")
    with pytest.raises(ValueError, match="cannot load this llava checkpoint"):
        VllmEngine(model_dir)
    compute = LlavaCompute(model_dir)
    imgs = [image(1), image(2, (120, 80))]
    await run_parity(model_dir, compute, {
        "text": (msgs(0), [], {}),
        "one_image": (msgs(1), [compute.preprocess_image(imgs[0])], {"images": imgs[:1]}),
        "two_images": (msgs(2), [compute.preprocess_image(i) for i in imgs], {"images": imgs}),
    }, engine_dir=hub_layout_copy(model_dir, tmp_path / "llava-hub"))


async def test_qwen2_audio_clips_match_generate(tmp_path):
    from shared.engines.qwen2_audio import Qwen2AudioCompute
    from shared.models.qwen2_audio_tiny import ensure_tiny_qwen2_audio
    from tests.unit.test_engine_qwen2_audio import clip, msgs

    model_dir = ensure_tiny_qwen2_audio(CACHE_DIR / "models")
    with pytest.raises(ValueError, match="cannot load this qwen2_audio checkpoint"):
        VllmEngine(model_dir)
    compute = Qwen2AudioCompute(model_dir)
    clips = [clip(440.0, 0.5), clip(2000.0, 1.5)]
    await run_parity(model_dir, compute, {
        "one_clip": (msgs(1), [compute.preprocess_audio(clips[0])], {"audios": clips[:1]}),
        "two_clips": (msgs(2), [compute.preprocess_audio(c) for c in clips], {"audios": clips}),
    }, engine_dir=hub_layout_copy(model_dir, tmp_path / "qwen2-audio-hub"))
