"""The family registry: which modalities each family takes and each engine serves, how the
gateway and the vllm engine apply it, and how a demo model is chosen."""

from __future__ import annotations

import json

import pytest
import torch

from services.gateway import schema
from services.gateway.prompt import PromptBuilder
from shared.engines.base import MediaEmbeds
from shared.models.registry import (
    FAMILIES,
    Family,
    family_of,
    raw_modalities,
    resolve_model_path,
    served_modalities,
    with_item_limits,
)
from shared.settings import Settings
from shared.stage import RequestFailed


def test_modalities_per_family_and_engine(model_dir):
    qwen = family_of(model_dir)
    assert qwen.name == "qwen2_vl" and qwen.modalities == {"image", "video"}
    assert qwen.image_placeholder == "<|image_pad|>" and qwen.placeholders["video"] == "<|video_pad|>"
    assert served_modalities(qwen, "transformers") == {"image", "video"}
    assert served_modalities(qwen, "vllm") == {"image", "video"}
    assert served_modalities(FAMILIES["llava"], "vllm") == {"image"}
    assert served_modalities(FAMILIES["qwen2_audio"], "vllm") == {"audio"}
    assert served_modalities(FAMILIES["llava_next"], "vllm") == {"image"}
    # LLaVA-NeXT-Video's videos reach vLLM as raw frames (its model takes no video embeddings)
    assert served_modalities(FAMILIES["llava_next_video"], "vllm") == {"video"}
    assert raw_modalities(FAMILIES["llava_next_video"], "vllm") == {"video"}
    assert not raw_modalities(FAMILIES["llava_next_video"], "transformers")
    assert raw_modalities(FAMILIES["llava_next"], "vllm") == {"image"} and not raw_modalities(qwen, "vllm")
    # vLLM's LLaVA-NeXT-Video takes one video per prompt: the gateway's limit follows
    limited = with_item_limits(Settings(engine="vllm"), FAMILIES["llava_next_video"])
    assert limited.max_videos_per_request == 1 and limited.max_images_per_request == Settings().max_images_per_request
    assert with_item_limits(Settings(engine="transformers"), FAMILIES["llava_next_video"]) == Settings()
    assert with_item_limits(Settings(engine="vllm"), qwen) == Settings(engine="vllm")
    with pytest.raises(ValueError, match="engine 'vllm' does not serve mystery models; it serves"):
        served_modalities(Family("mystery", {"image": "<image>"}), "vllm")
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        served_modalities(qwen, "tgi")
    assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen2_audio", "llava", "llava_next", "llava_next_video"}


def test_unknown_family_and_demo(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(ValueError, match="model type 'whisper'"):
        family_of(tmp_path)
    with pytest.raises(ValueError, match="unknown demo_model 'gpt'; choose from qwen2-vl, qwen2-vl:bench, "
                                         "qwen2.5-vl, qwen2-audio, llava, llava-next, llava-next-video"):
        resolve_model_path(Settings(demo_model="gpt", cache_dir=str(tmp_path)))


def test_gateway_with_vllm_takes_video(model_dir):
    builder = PromptBuilder.for_model(model_dir, Settings(engine="vllm"))
    assert builder.modalities == {"image", "video"}
    body = json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}).encode()
    with pytest.raises(RequestFailed) as info:
        builder.chat(schema.parse_chat(body))
    assert info.value.event.status == 400 and "does not accept audio input" in info.value.event.message


def test_vllm_prompts_check_items_against_placeholders(model_dir):
    pytest.importorskip("vllm")
    from shared.engines.base import EngineError
    from shared.engines.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir)  # not started: building a prompt needs no engine core
    tok = engine.tokenizer.convert_tokens_to_ids
    image_id, video_id = tok("<|image_pad|>"), tok("<|video_pad|>")
    image, video = MediaEmbeds(torch.zeros(4, 128), (1, 4, 4), "image", mm_hash="h1"), \
        MediaEmbeds(torch.zeros(4, 128), (2, 2, 4), "video", mm_hash="h2")
    prompt = engine.prompts.build([1, image_id, video_id], [image, video], tail=(video_id,))
    assert prompt["prompt_token_ids"] == [1, image_id, video_id, video_id]
    assert set(prompt["multi_modal_data"]) == {"image", "video"}
    assert prompt["multi_modal_data"]["video"]["video_grid_thw"].tolist() == [[2, 2, 4]]
    assert prompt["multi_modal_uuids"] == {"image": ["h1"], "video": ["h2"]}
    with pytest.raises(EngineError, match="1 video placeholders but 0 video items"):
        engine.prompts.build([1, image_id, video_id], [image])
    with pytest.raises(EngineError, match="not audio"):
        engine.prompts.build([1, image_id], [image, MediaEmbeds(torch.zeros(4, 128), (0, 0, 0), "audio")])
    with pytest.raises(EngineError, match="does not fit grid"):
        engine.prompts.build([1, image_id], [MediaEmbeds(torch.zeros(5, 128), (1, 4, 4), "image")])
    # zero placeholders (a decode consumer's) carry no mm_hash: no uuid, zeros never named as an item
    assert "multi_modal_uuids" not in engine.prompts.build([1, image_id],
                                                            [MediaEmbeds(torch.zeros(4, 128), (1, 4, 4))])
