"""Workers load only what they run (shared.models.loading): an encode worker's model holds the
vision tower + projector and no LM weight, a prefill / decode worker's holds no vision tower, both
loaded from the checkpoint (equal to the whole model's tensors) in the checkpoint's dtype, and
the two halves together give ``generate()``'s tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engines.base import MediaEmbeds
from shared.engines.qwen2_vl import Qwen2VLCompute
from shared.engines.registry import make_engine, parts_for
from shared.models.loading import ALL_PARTS, ENCODER, LM, weight_bytes
from shared.models.reference import load_reference, reference_generate
from shared.process.device import resolve_placement
from shared.settings import Settings
from tests.unit.test_engine_qwen2_vl import MAX_NEW_TOKENS, greedy_decode, messages_for

LM_PREFIXES = ("model.language_model.", "lm_head.")


@pytest.fixture(scope="module")
def full(model_dir):
    return Qwen2VLCompute(model_dir)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (80, 120, 3), dtype=np.uint8))


def _same_tensors(part, whole) -> None:
    mine = dict(part.named_parameters())
    theirs = dict(whole.named_parameters())
    assert mine and set(mine) <= set(theirs)
    for name, p in mine.items():  # loaded from the checkpoint, not freshly initialised
        assert torch.equal(p, theirs[name]), name


def test_parts_per_worker():
    assert parts_for(("encode",)) == {ENCODER}
    assert parts_for(("prefill",)) == parts_for(("decode",)) == parts_for(("prefill", "decode")) == {LM}
    assert parts_for(("encode", "prefill", "decode")) == parts_for(()) == ALL_PARTS
    assert parts_for(("encode", "prefill"), "vllm") == {ENCODER}  # vLLM runs the LM itself
    engine = make_engine("transformers", Settings(), "unused", ("media-fetch", "encode"))
    assert engine._parts == {ENCODER}


def test_a_worker_that_only_decodes_gets_the_decode_core():
    """The decode core (a child process) holds the LM where the worker's LM engine only decodes;
    a worker that also prefills or encodes keeps the engine in-process, as does ``decode_core`` off."""
    from shared.engines.decode_core import CoreDecodeEngine
    from shared.engines.transformers_engine import TransformersEngine

    for stages in (("decode",), ("media-fetch", "decode")):
        assert isinstance(make_engine("transformers", Settings(), "unused", stages), CoreDecodeEngine)
    for stages in (("prefill", "decode"), ("encode", "decode"), ("prefill",), ()):
        assert isinstance(make_engine("transformers", Settings(), "unused", stages), TransformersEngine)
    off = Settings(decode_core=False)
    assert isinstance(make_engine("transformers", off, "unused", ("decode",)), TransformersEngine)


def test_encoder_holds_no_lm_weights(model_dir, full):
    enc = Qwen2VLCompute(model_dir, parts=frozenset({ENCODER}))
    names = [n for n, _ in enc.model.named_parameters()]
    assert not [n for n in names if n.startswith(LM_PREFIXES)]
    assert all(n.startswith("model.visual.") for n in names)
    _same_tensors(enc.model, full.model)
    held = weight_bytes(enc.model)
    assert held["lm"] == 0 and held["encoder"] == weight_bytes(full.model)["encoder"] > 0
    px = [enc.preprocess_image(_image(s)) for s in (1, 2)]
    for a, b in zip(enc.encode_media(px), full.encode_media(px)):
        assert torch.equal(a, b)


def test_lm_worker_holds_no_vision_tower(model_dir, full):
    lm = Qwen2VLCompute(model_dir, parts=frozenset({LM}))
    names = [n for n, _ in lm.model.named_parameters()]
    assert names and all(n.startswith(LM_PREFIXES) for n in names)
    _same_tensors(lm.model, full.model)
    assert weight_bytes(lm.model)["encoder"] == 0


def test_the_two_halves_match_generate(model_dir, full):
    enc = Qwen2VLCompute(model_dir, parts=frozenset({ENCODER}))
    lm = Qwen2VLCompute(model_dir, parts=frozenset({LM}))
    img = _image(7)
    expected = reference_generate(model_dir, messages_for(1), [img], MAX_NEW_TOKENS, loaded=load_reference(model_dir))
    px = enc.preprocess_image(img)
    (feats,) = enc.encode_media([px])
    prefill = lm.prefill(lm.render_prompt_ids(messages_for(1)), [MediaEmbeds(feats, px.grid_thw)])
    assert greedy_decode(lm, prefill, MAX_NEW_TOKENS) == expected


def test_llava_encoder_is_tower_and_projector():
    from shared.engines.llava import LlavaCompute
    from shared.models.llava_tiny import ensure_tiny_llava
    from tests.conftest import CACHE_DIR

    enc = LlavaCompute(ensure_tiny_llava(CACHE_DIR / "models"), parts=frozenset({ENCODER}))
    tops = {n.split(".")[1] for n, _ in enc.model.named_parameters()}
    assert tops == {"vision_tower", "multi_modal_projector"}


def test_checkpoint_dtype_is_kept(model_dir, tmp_path):
    """bf16 safetensors load as bf16 under dtype=auto; float32 checkpoints stay float32 on CPU;
    an explicit dtype setting wins."""
    from tests.hubcache import build_hub_cache

    snapshot = build_hub_cache(model_dir, tmp_path / "hub")
    enc = Qwen2VLCompute(snapshot, parts=frozenset({ENCODER}))
    assert enc.dtype == torch.bfloat16 and {p.dtype for p in enc.model.parameters()} == {torch.bfloat16}
    (feats,) = enc.encode_media([enc.preprocess_image(_image(3))])
    assert feats.dtype == torch.bfloat16
    assert resolve_placement("cpu", "auto", torch.float32).dtype == torch.float32
    assert resolve_placement("cpu", "float32", torch.bfloat16).dtype == torch.float32
    as_f32 = Qwen2VLCompute(snapshot, dtype="float32", parts=frozenset({LM}))
    assert {p.dtype for p in as_f32.model.parameters()} == {torch.float32}
