"""What the vLLM engine hands vLLM for Qwen videos (no engine started): a Qwen2.5-VL video's
time step goes beside its embeddings as ``second_per_grid_ts`` (vLLM's positions step by it),
a video without one is refused, Qwen2-VL's take none; prefill's ``MediaShape`` carries the step
to a decode consumer's placeholders, and a record written before the field reads as 0."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from shared import protocol
from shared.engines.base import EngineError, MediaEmbeds
from shared.engines.vllm_inputs import PromptBuilder
from shared.engines.vllm_pd import placeholder_media
from shared.models.qwen2_5_vl_tiny import ensure_tiny_qwen2_5_vl
from tests.conftest import CACHE_DIR

GRID = (2, 4, 4)  # 8 LM tokens at merge size 2


@pytest.fixture(scope="module")
def q25_dir():
    return ensure_tiny_qwen2_5_vl(CACHE_DIR / "models")


def _builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir, AutoTokenizer.from_pretrained(model_dir), max_items_per_prompt=4)


def _video_prompt(builder: PromptBuilder, n: int) -> list[int]:
    return [1, *([builder.placeholders["video"]] * n), 2]


def _video(step: float, hidden: int = 8) -> MediaEmbeds:
    return MediaEmbeds(torch.randn(8, hidden), GRID, "video", second_per_grid_t=step, mm_hash=f"v{step}")


def test_qwen2_5_vl_videos_carry_their_time_steps(q25_dir):
    builder = _builder(q25_dir)
    assert builder.modalities == {"image", "video"}
    prompt = builder.build(_video_prompt(builder, 2), [_video(0.5), _video(0.25)])
    video = prompt["multi_modal_data"]["video"]
    assert video["second_per_grid_ts"].tolist() == [0.5, 0.25]
    assert video["video_grid_thw"].tolist() == [list(GRID)] * 2 and video["video_embeds"].shape[0] == 16
    with pytest.raises(EngineError, match="second_per_grid_t"):
        builder.build(_video_prompt(builder, 2), [_video(0.5), _video(0.0)])


def test_qwen2_vl_videos_take_no_time_step(model_dir):
    builder = _builder(model_dir)
    video = builder.build(_video_prompt(builder, 1), [_video(0.0)])["multi_modal_data"]["video"]
    assert set(video) == {"video_embeds", "video_grid_thw"}


def test_the_step_reaches_a_decode_consumers_placeholders():
    shape = protocol.MediaShape("video", GRID, 8, 0.5)
    (item,) = placeholder_media((shape,), hidden_size=8)
    assert (item.kind, item.grid_thw, item.second_per_grid_t, tuple(item.embeds.shape)) == ("video", GRID, 0.5, (8, 8))
    old = msgspec.msgpack.encode({"kind": "video", "grid_thw": list(GRID), "n_tokens": 8})
    assert msgspec.msgpack.decode(old, type=protocol.MediaShape).second_per_grid_t == 0.0
