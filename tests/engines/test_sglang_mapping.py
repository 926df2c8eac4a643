"""The SGLang engine's pure parts, on CPU without SGLang: sampling controls to SGLang's
``sampling_params`` (and the ones refused by name), stream chunks back to tokens, prompt ids +
embeddings to ``async_generate``'s prompt arguments, ``sglang_*`` settings to ``ServerArgs``
keywords, and every start-up refusal (a worker, ``mmfleet up``, the modes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.modes import supported_modes
from shared import protocol
from shared.engines import sglang_config, sglang_sampling
from shared.engines.base import EngineError, MediaEmbeds, SampledToken
from shared.engines.registry import engine_capabilities
from shared.engines.sglang_inputs import PromptBuilder
from shared.models.registry import FAMILIES, served_modalities
from shared.settings import Settings
from shared.settings_sglang import SglangSettings

SGLANG_HERE = importlib.util.find_spec("sglang") is not None


# ---------------------------------------------------------------- sampling
def test_every_control_maps_to_sglangs_name():
    s = protocol.Sampling(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5,
                          frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias=((7, -3.0), (11, 2.5)),
                          min_tokens=4, ignore_eos=True, stop_token_ids=(13, 3))
    p = sglang_sampling.sampling_params(s, already=1)
    assert p == {"max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                 "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.1,
                 "min_new_tokens": 3, "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True,
                 "stop_token_ids": [3, 13], "logit_bias": {"7": -3.0, "11": 2.5}}
    plain = sglang_sampling.sampling_params(protocol.Sampling(max_tokens=2, temperature=0.0, min_tokens=5))
    assert plain["top_k"] == -1 and plain["min_new_tokens"] == 2  # top_k 0 is off; min never above max
    assert "stop_token_ids" not in plain and "logit_bias" not in plain
    assert sglang_sampling.logprob_args(protocol.Sampling()) == {}
    assert sglang_sampling.logprob_args(protocol.Sampling(logprobs=3)) == {
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": -1}


@pytest.mark.parametrize(("sampling", "said"), [
    (protocol.Sampling(max_tokens=0), "max_tokens must be >= 1"),
    (protocol.Sampling(structured=protocol.StructuredOutput("json_object")), "does not serve structured output"),
    (protocol.Sampling(seed=3, temperature=0.8), "does not take a sampling seed"),
])
def test_what_sglang_cannot_do_is_refused_by_name(sampling, said):
    with pytest.raises(EngineError, match=said):
        sglang_sampling.sampling_params(sampling)


def test_a_seed_at_temperature_zero_changes_nothing_and_is_taken():
    assert sglang_sampling.refusal(protocol.Sampling(seed=3, temperature=0.0)) is None


def test_cumulative_chunks_become_new_tokens_once():
    reader = sglang_sampling.StreamReader(protocol.Sampling())
    assert reader.feed({"output_ids": [5], "meta_info": {"finish_reason": None}}) == [5]
    assert reader.feed({"output_ids": [5, 6, 7], "meta_info": {"finish_reason": None}}) == [6, 7]
    assert reader.feed({"output_ids": [5, 6, 7], "meta_info": {}}) == []  # a chunk with nothing new
    assert not reader.finished
    assert reader.feed({"output_ids": [5, 6, 7, 2], "meta_info": {"finish_reason": {"type": "stop"}}}) == [2]
    assert reader.finished


def test_logprobs_come_back_as_sampled_tokens():
    reader = sglang_sampling.StreamReader(protocol.Sampling(logprobs=1))
    meta = {"finish_reason": None, "output_token_logprobs": [(-0.5, 5, None), (-1.5, 6, None)],
            "output_top_logprobs": [[(-0.5, 5, None), (-2.0, 9, None)], [(-0.1, 8, None)]]}
    got = reader.feed({"output_ids": [5, 6], "meta_info": meta})
    assert got == [5, 6] and all(isinstance(t, SampledToken) for t in got)
    assert got[0].logprob == protocol.TokenLogprob(5, -0.5, ((5, -0.5),))
    assert got[1].logprob == protocol.TokenLogprob(6, -1.5, ((8, -0.1),))
    with pytest.raises(EngineError, match="logprob 0 is of token 5, its output has 4"):
        sglang_sampling.StreamReader(protocol.Sampling(logprobs=1)).feed({"output_ids": [4], "meta_info": meta})


def test_an_abort_from_sglang_is_an_engine_error_with_its_message():
    reader = sglang_sampling.StreamReader(protocol.Sampling())
    with pytest.raises(EngineError, match="sglang aborted the request: the input is too long"):
        reader.feed({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort",
                                                                       "message": "the input is too long"}}})


# ---------------------------------------------------------------- prompts
def _ids(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok, tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")


def test_the_registry_serves_qwen_text_only_and_names_what_it_refuses(model_dir):
    assert served_modalities(FAMILIES["qwen2_vl"], "sglang") == frozenset()
    assert served_modalities(FAMILIES["qwen2_5_vl"], "sglang") == frozenset()
    with pytest.raises(ValueError, match=r"engine 'sglang' does not serve llava models \(the sglang engine is "
                                         r"checked on Qwen-VL models only\)"):
        served_modalities(FAMILIES["llava"], "sglang")
    tok, image_id, _ = _ids(model_dir)
    fleet = PromptBuilder(model_dir, tok, 8)
    assert fleet.modalities == frozenset()
    assert fleet.build([1, 2, 3], []) == {"input_ids": [1, 2, 3]}
    with pytest.raises(EngineError, match="serves no embeddings of qwen2_vl models, not image"):
        fleet.build([1, image_id], [MediaEmbeds(torch.zeros(4, 8), (1, 4, 4))])


def test_an_image_travels_expanded_with_one_processor_output_dict(model_dir):
    tok, image_id, video_id = _ids(model_dir)
    builder = PromptBuilder(model_dir, tok, 8, modalities=frozenset({"image", "video", "audio"}))
    assert builder.modalities == {"image", "video"}  # only what the family takes
    emb = torch.arange(4 * 8, dtype=torch.bfloat16).reshape(4, 8)
    out = builder.build([1, image_id, 2], [MediaEmbeds(emb, (1, 4, 4), "image", mm_hash="h")], tail=(image_id,))
    assert out["input_ids"] == [1, image_id, image_id, image_id, image_id, 2, image_id]  # tail not expanded
    (item,) = out["image_data"]
    assert item["format"] == "processor_output" and item["modality"] == "IMAGE"
    assert item["precomputed_embeddings"].dtype == torch.float32
    assert torch.equal(item["precomputed_embeddings"], emb.float())
    assert item["image_grid_thw"].tolist() == [[1, 4, 4]] and "video_data" not in out
    video = builder.build([video_id], [MediaEmbeds(torch.zeros(8, 8), (2, 4, 4), "video")])
    assert len(video["input_ids"]) == 8 and video["video_data"][0]["video_grid_thw"].tolist() == [[2, 4, 4]]


def test_items_are_checked_against_placeholders_and_grids(model_dir):
    tok, image_id, _ = _ids(model_dir)
    builder = PromptBuilder(model_dir, tok, 2, modalities=frozenset({"image"}))
    one = MediaEmbeds(torch.zeros(4, 8), (1, 4, 4))
    with pytest.raises(EngineError, match="prompt has 2 image placeholders but 1 image items given"):
        builder.build([image_id, image_id], [one])
    with pytest.raises(EngineError, match="does not fit grid"):
        builder.build([image_id], [MediaEmbeds(torch.zeros(5, 8), (1, 4, 4))])
    with pytest.raises(EngineError, match="takes one image per request from embeddings, got 2"):
        builder.build([image_id, image_id], [one, one])
    with pytest.raises(EngineError, match="3 media items exceed this engine's limit of 2"):
        builder.build([image_id] * 3, [one] * 3)


# ---------------------------------------------------------------- settings and start-up
def test_server_args_pass_only_the_knobs_set(model_dir):
    args = sglang_config.server_args(model_dir, SglangSettings(), dtype="bfloat16", seed=0, context_length=4096)
    assert {"mem_fraction_static", "max_running_requests", "chunked_prefill_size"}.isdisjoint(args)
    assert (args["model_path"], args["device"], args["tp_size"], args["base_gpu_id"]) == (str(model_dir), "cuda",
                                                                                          1, 0)
    knobs = SglangSettings(sglang_mem_fraction_static=0.3, sglang_max_running_requests=16, sglang_tp_size=2,
                           sglang_chunked_prefill_size_tokens=-1, sglang_disable_radix_cache=True,
                           sglang_disable_cuda_graph=True)
    args = sglang_config.server_args(model_dir, knobs, dtype="bfloat16", seed=5, context_length=2048, gpu_id=1)
    assert (args["mem_fraction_static"], args["max_running_requests"], args["tp_size"], args["chunked_prefill_size"],
            args["disable_radix_cache"], args["disable_cuda_graph"], args["random_seed"], args["context_length"],
            args["base_gpu_id"]) == (0.3, 16, 2, -1, True, True, 5, 2048, 1)


@pytest.mark.parametrize(("changes", "said"), [
    ({"sglang_mem_fraction_static": 1.0}, "sglang_mem_fraction_static must be in"),
    ({"sglang_tp_size": 0}, "sglang_tp_size must be 1 or more"),
    ({"sglang_max_running_requests": -1}, "sglang_max_running_requests must be 0"),
    ({"sglang_chunked_prefill_size_tokens": -2}, "sglang_chunked_prefill_size_tokens must be -1"),
])
def test_out_of_range_knobs_are_refused_when_read(changes, said):
    with pytest.raises(ValueError, match=said):
        Settings(**changes)


def test_the_knobs_are_read_from_the_environment():
    from shared.settings import from_env

    s = from_env({"MMFLEET_ENGINE": "sglang", "MMFLEET_SGLANG_TP_SIZE": "2",
                  "MMFLEET_SGLANG_DISABLE_RADIX_CACHE": "true"})
    assert (s.engine, s.sglang_tp_size, s.sglang_disable_radix_cache) == ("sglang", 2, True)


def test_start_up_refusals_name_the_reason_and_the_setting():
    missing = sglang_config.startup_refusal("cuda", {}, importable=False)
    assert missing.startswith("sglang is not installed: pip install sglang==0.5.12 on a CUDA host")
    assert "device is 'cpu' (setting device" in sglang_config.startup_refusal("cpu", {}, importable=True)
    hidden = sglang_config.startup_refusal("cuda", {"CUDA_VISIBLE_DEVICES": ""}, importable=True)
    assert "CUDA_VISIBLE_DEVICES='' hides every one" in hidden
    assert "torch sees none" in sglang_config.startup_refusal("cuda:0", {}, importable=True, gpu_count=0)
    assert sglang_config.startup_refusal("cuda:1", {}, importable=True, gpu_count=2) is None


def test_settings_the_device_or_model_cannot_take_are_refused(model_dir):
    knobs = SglangSettings(sglang_tp_size=2, sglang_context_length_tokens=10**6, sglang_max_running_requests=64,
                           sglang_chunked_prefill_size_tokens=32)
    said = " | ".join(sglang_config.refusals(knobs, model_dir, "cuda", gpu_count=1))
    assert "sglang_tp_size 2 needs 2 GPUs, but device 'cuda' sees 1" in said
    assert "above the context of the model" in said and "below sglang_max_running_requests 64" in said
    assert "names a GPU this process does not see" in sglang_config.refusals(SglangSettings(), model_dir, "cuda:3",
                                                                             gpu_count=1)[0]
    assert sglang_config.refusals(SglangSettings(), model_dir, "cuda:0", gpu_count=1) == []


def test_sglang_serves_epd_and_e_pd_only():
    assert supported_modes(engine_capabilities("sglang")) == ["epd", "e-pd"]


@pytest.mark.skipif(SGLANG_HERE, reason="sglang is installed here")
def test_a_worker_without_sglang_refuses_at_once(model_dir):
    from services.worker import _preflight

    with pytest.raises(SystemExit, match="cannot start worker: sglang is not installed: pip install sglang==0.5.12"):
        _preflight(Settings(engine="sglang", model=str(model_dir)), ("prefill", "decode"))
    with pytest.raises(SystemExit, match="engine 'sglang' cannot run prefill apart from decode"):
        _preflight(Settings(engine="sglang", model=str(model_dir)), ("prefill",))
