"""vLLM's serving knobs as settings: read from every source (environment, config file, the
``vllm serve``-spelled flags of ``mmfleet up`` / ``mmfleet worker``), turned into vLLM's engine
arguments without starting anything, and every combination the device or model cannot take
refused at start naming the settings that clash (no vLLM needed; the read-back through vLLM's
own config is tests/engines/test_vllm_config.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.cli import _parser, load_settings
from shared import settings_doc
from shared.engines import vllm_config
from shared.settings import Settings, field_names, from_env, redacted, to_env
from shared.settings_vllm import VllmSettings

KNOBS = VllmSettings.__struct_fields__


def test_the_knobs_are_settings_like_any_other(tmp_path):
    assert set(KNOBS) <= set(field_names()) and field_names()[-len(KNOBS):] == KNOBS  # listed after the fleet's
    assert {d.name for d in settings_doc.describe()} >= set(KNOBS)
    assert "MMFLEET_VLLM_MAX_NUM_SEQS" in settings_doc.markdown_table()
    cfg = tmp_path / "m.toml"
    cfg.write_text("vllm_max_num_seqs = 7\nvllm_enforce_eager = true\nvllm_enable_chunked_prefill = 'auto'\n")
    s = from_env({"MMFLEET_VLLM_ENABLE_CHUNKED_PREFILL": "false", "MMFLEET_VLLM_KV_CACHE_DTYPE": "fp8"},
                 config_file=cfg, vllm_tensor_parallel_size=2)
    assert (s.vllm_max_num_seqs, s.vllm_enforce_eager, s.vllm_enable_chunked_prefill, s.vllm_kv_cache_dtype,
            s.vllm_tensor_parallel_size) == (7, True, False, "fp8", 2)
    assert from_env(to_env(s)) == s  # what a child process is given reproduces them
    assert redacted(s)["vllm_max_num_seqs"] == 7
    assert Settings().vllm_enforce_eager == "auto" and Settings().vllm_enable_prefix_caching is True


@pytest.mark.parametrize(("changes", "match"), [
    ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization must be in"),
    ({"vllm_tensor_parallel_size": 0}, "vllm_tensor_parallel_size must be 1 or more"),
    ({"vllm_max_num_seqs": -1}, "vllm_max_num_seqs must be 0"),
    ({"vllm_kv_cache_dtype": ""}, "vllm_kv_cache_dtype must name"),
])
def test_values_out_of_range_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        Settings(**changes)
    with pytest.raises(ValueError, match="vllm_enforce_eager"):
        from_env({"MMFLEET_VLLM_ENFORCE_EAGER": "sometimes"})


def test_vllm_serve_flags_set_the_settings():
    argv = ["up", "--max-model-len", "32k", "--gpu-memory-utilization", "0.92", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "8K", "-tp", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
            "--no-enforce-eager", "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
            "--limit-mm-per-prompt", '{"image": 4, "video": {"count": 2}}']
    s = load_settings(_parser().parse_args(argv), env={"MMFLEET_VLLM_MAX_NUM_SEQS": "3"})
    assert (s.vllm_max_model_len_tokens, s.vllm_gpu_memory_utilization, s.vllm_max_num_seqs,
            s.vllm_max_num_batched_tokens, s.vllm_tensor_parallel_size, s.vllm_quantization,
            s.vllm_kv_cache_dtype) == (32_000, 0.92, 64, 8192, 2, "fp8", "fp8")
    assert (s.vllm_enforce_eager, s.vllm_enable_chunked_prefill, s.vllm_enable_prefix_caching) == (False, False, False)
    assert (s.max_images_per_request, s.max_videos_per_request, s.max_audios_per_request) == (4, 2, 0)
    worker = load_settings(_parser().parse_args(["worker", "--stages", "decode", "--enforce-eager"]), env={})
    assert worker.vllm_enforce_eager is True and worker.vllm_enable_chunked_prefill == "auto"
    unset = load_settings(_parser().parse_args(["up"]), env={"MMFLEET_VLLM_ENABLE_PREFIX_CACHING": "false"})
    assert unset.vllm_enable_prefix_caching is False  # a flag not given leaves the environment's value


@pytest.mark.parametrize("value", ['{"image": 0}', '{"pointcloud": 1}', "[4]", "{image: 4}", '{"image": true}'])
def test_a_limit_mm_per_prompt_mmfleet_cannot_honour_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["up", "--limit-mm-per-prompt", value])
    assert info.value.code == 2 and "--limit-mm-per-prompt" in capsys.readouterr().err


def test_engine_args_pass_only_what_is_set():
    common = dict(device="cpu", dtype="float32", seed=0, max_model_len=4096, block_size=32, kv_cache_bytes=1 << 20,
                  limits={"image": 8})
    args = vllm_config.engine_args("/m", VllmSettings(), kv_role=None, **common)
    for vllm_default in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "quantization",
                         "enable_chunked_prefill"):
        assert vllm_default not in args  # vLLM applies its own
    assert args["enforce_eager"] is True and args["enable_prefix_caching"] is True
    assert (args["tensor_parallel_size"], args["kv_cache_dtype"], args["limit_mm_per_prompt"]) == (1, "auto",
                                                                                                  {"image": 8})
    gpu = vllm_config.engine_args("/m", VllmSettings(), kv_role=None, **{**common, "device": "cuda:0"})
    assert gpu["enforce_eager"] is False  # auto: CUDA graphs on a GPU
    consumer = vllm_config.engine_args("/m", VllmSettings(), kv_role="kv_consumer", **common)
    assert consumer["enable_prefix_caching"] is False  # its placeholders are zeros
    knobs = VllmSettings(vllm_gpu_memory_utilization=0.5, vllm_max_num_seqs=4, vllm_max_num_batched_tokens=512,
                         vllm_quantization="awq", vllm_enable_chunked_prefill=False, vllm_enforce_eager=True)
    set_ = vllm_config.engine_args("/m", knobs, kv_role=None, **{**common, "device": "cuda"})
    assert (set_["gpu_memory_utilization"], set_["max_num_seqs"], set_["max_num_batched_tokens"],
            set_["quantization"], set_["enable_chunked_prefill"], set_["enforce_eager"]) == (0.5, 4, 512, "awq",
                                                                                            False, True)


def test_per_modality_limits_come_from_the_media_settings():
    assert vllm_config.mm_limits(Settings()) == {"image": 8, "video": 8, "audio": 8}
    s = Settings(max_media_items=12, max_images_per_request=3)
    assert vllm_config.mm_limits(s) == {"image": 3, "video": 12, "audio": 12}


def refused(model_dir, device="cpu", dtype="float32", **changes) -> str:
    return "; ".join(vllm_config.refusals(Settings(**changes), model_dir, device, dtype, gpu_count=8,
                                          cpu_fp8_kv=False))


def test_defaults_and_what_the_device_can_take_are_not_refused(model_dir):
    assert refused(model_dir) == ""
    assert refused(model_dir, vllm_enforce_eager=True, vllm_max_model_len_tokens=4096, vllm_max_num_seqs=4,
                   vllm_max_num_batched_tokens=4096, vllm_enable_chunked_prefill=False, vllm_kv_cache_dtype="auto",
                   max_media_items=4, max_images_per_request=4) == ""
    assert refused(model_dir, "cuda", "bfloat16", vllm_tensor_parallel_size=8, vllm_enforce_eager=False,
                   vllm_quantization="fp8", vllm_kv_cache_dtype="fp8") == ""
    assert vllm_config.refusals(Settings(vllm_kv_cache_dtype="fp8"), model_dir, "cpu", "float32", cpu_fp8_kv=True) == []


@pytest.mark.parametrize(("device", "dtype", "changes", "names"), [
    ("cpu", "float32", {"vllm_tensor_parallel_size": 2}, ["vllm_tensor_parallel_size 2", "device is 'cpu'"]),
    ("cuda:1", "bfloat16", {"vllm_tensor_parallel_size": 2}, ["vllm_tensor_parallel_size 2", "device 'cuda:1'"]),
    ("cuda", "bfloat16", {"vllm_tensor_parallel_size": 16}, ["vllm_tensor_parallel_size 16", "'cuda' sees 8"]),
    ("cpu", "float32", {"vllm_enforce_eager": False}, ["vllm_enforce_eager false", "device is 'cpu'"]),
    ("cpu", "float32", {"vllm_max_model_len_tokens": 8192}, ["vllm_max_model_len_tokens 8192", "setting model",
                                                            "4096 tokens"]),
    ("cpu", "float32", {"vllm_max_num_batched_tokens": 1024, "vllm_enable_chunked_prefill": False},
     ["vllm_max_num_batched_tokens 1024", "max model length (4096", "vllm_enable_chunked_prefill false"]),
    ("cpu", "float32", {"vllm_max_num_batched_tokens": 1024, "vllm_max_model_len_tokens": 2048,
                        "vllm_enable_chunked_prefill": False}, ["vllm_max_model_len_tokens", "(2048 tokens"]),
    ("cpu", "float32", {"vllm_max_num_batched_tokens": 32, "vllm_max_num_seqs": 64},
     ["vllm_max_num_batched_tokens 32", "vllm_max_num_seqs 64"]),
    ("cpu", "float32", {"vllm_kv_cache_dtype": "fp8"}, ["vllm_kv_cache_dtype fp8", "device 'cpu'", "AVX-512"]),
    ("cuda", "float32", {"vllm_quantization": "awq"}, ["vllm_quantization awq", "dtype gives float32"]),
    ("cpu", "bfloat16", {"vllm_quantization": "fp8"}, ["vllm_quantization fp8", "no CPU kernels", "'cpu'"]),
    ("cpu", "float32", {"max_media_items": 4, "max_videos_per_request": 6},
     ["max_videos_per_request 6", "max_media_items 4"]),
])
def test_each_impossible_combination_is_refused_naming_both_settings(model_dir, device, dtype, changes, names):
    why = refused(model_dir, device, dtype, **changes)
    for name in names:
        assert name in why, why


def test_fp8_kv_refuses_a_head_size_vllm_cpu_cannot_take(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["num_attention_heads"] = 8  # 128 / 8 = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    why = vllm_config.refusals(Settings(vllm_kv_cache_dtype="fp8_e5m2"), tmp_path, "cpu", "float32", cpu_fp8_kv=True)
    assert why == ["vllm_kv_cache_dtype fp8_e5m2 on device 'cpu' needs a head size divisible by 32; the model's is 16"]


def test_a_worker_refuses_before_it_connects_to_anything(model_dir):
    from services.worker import run_worker

    s = Settings(model=str(model_dir), engine="vllm", vllm_tensor_parallel_size=2, vllm_enforce_eager=False,
                 redis_url="redis://127.0.0.1:1/0")  # nothing listens there: the refusal comes first
    with pytest.raises(SystemExit, match=r"cannot start worker: vllm_tensor_parallel_size 2 needs GPUs, but device "
                                         r"is 'cpu'.*; vllm_enforce_eager false asks for CUDA graphs"):
        asyncio.run(run_worker(s, ["prefill", "decode"]))
    encode_only = Settings(model=str(model_dir), engine="vllm", vllm_tensor_parallel_size=2)
    from services.worker import _preflight

    assert _preflight(encode_only, ("media-fetch", "encode"))[0] == model_dir  # its engine is not vLLM's


def test_up_refuses_before_it_starts_anything(model_dir, capsys):
    from services.supervisor import run_up

    s = Settings(model=str(model_dir), engine="vllm", vllm_max_model_len_tokens=1 << 20, zygote=False,
                 kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0")
    assert asyncio.run(run_up(s, mode="epd", log_dir=None)) == 2
    err = capsys.readouterr().err
    assert "mmfleet up: cannot start: vllm_max_model_len_tokens 1048576 is above the context of the model" in err


def test_the_gateway_holds_requests_to_the_engines_max_model_length(model_dir):
    from services.gateway.prompt import PromptBuilder

    assert PromptBuilder.for_model(model_dir, Settings(engine="vllm", vllm_max_model_len_tokens=1024)) \
        .context_tokens == 1024
    assert PromptBuilder.for_model(model_dir, Settings(engine="vllm")).context_tokens == 4096  # the model's
    assert PromptBuilder.for_model(model_dir, Settings(vllm_max_model_len_tokens=1024)).context_tokens == 4096
