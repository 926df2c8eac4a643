"""The family registry: which modalities each family takes and each engine serves, how the
gateway and the vllm engine apply it, and how a demo model is chosen."""

from __future__ import annotations

import json

import pytest
import torch

from services.gateway import schema
from services.gateway.prompt import PromptBuilder
from shared.engines.base import MediaEmbeds
from shared.models.registry import FAMILIES, Family, family_of, resolve_model_path, served_modalities
from shared.settings import Settings
from shared.stage import RequestFailed


def test_modalities_per_family_and_engine(model_dir):
    qwen = family_of(model_dir)
    assert qwen.name == "qwen2_vl" and qwen.modalities == {"image", "video"}
    assert qwen.image_placeholder == "<|image_pad|>" and qwen.placeholders["video"] == "<|video_pad|>"
    assert served_modalities(qwen, "transformers") == {"image", "video"}
    assert served_modalities(qwen, "vllm") == {"image"}
    with pytest.raises(ValueError, match="engine 'vllm' does not serve llava models"):
        served_modalities(Family("llava", {"image": "<image>"}), "vllm")
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        served_modalities(qwen, "sglang")
    assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen2_audio", "llava", "llava_next", "llava_next_video"}


def test_unknown_family_and_demo(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(ValueError, match="model type 'whisper'"):
        family_of(tmp_path)
    with pytest.raises(ValueError, match="unknown demo_model 'gpt'; choose from qwen2-vl, qwen2-vl:bench, "
                                         "qwen2.5-vl, qwen2-audio, llava, llava-next, llava-next-video"):
        resolve_model_path(Settings(demo_model="gpt", cache_dir=str(tmp_path)))


def test_gateway_with_vllm_refuses_video(model_dir):
    builder = PromptBuilder.for_model(model_dir, Settings(engine="vllm"))
    assert builder.modalities == {"image"}
    body = json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]}]}).encode()
    with pytest.raises(RequestFailed) as info:
        builder.chat(schema.parse_chat(body))
    assert info.value.event.status == 400 and "does not accept video input" in info.value.event.message
    assert PromptBuilder.for_model(model_dir, Settings()).modalities == {"image", "video"}


def test_vllm_engine_refuses_video_items(model_dir):
    pytest.importorskip("vllm")
    from shared.engines.base import EngineError
    from shared.engines.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir)  # not started: building a prompt needs no engine core
    video_id = engine.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    with pytest.raises(EngineError, match="image embeddings only, not video"):
        engine._prompt([1, engine.placeholder_token_id, video_id],
                       [MediaEmbeds(torch.zeros(4, 128), (1, 4, 4)), MediaEmbeds(torch.zeros(4, 128), (2, 2, 4),
                                                                                  "video")])
