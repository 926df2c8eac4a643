"""Each ``vllm_*`` setting reaches vLLM: the engine a worker builds (``make_engine``) hands its
engine arguments to vLLM's own config builder exactly as it does at start
(``vllm_process.engine_config``: same environment, same usage context), and the resulting
``VllmConfig`` is read back. Nothing is started (no engine core); vLLM's import dominates (~15 s)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, CompilationMode, SchedulerConfig  # noqa: E402

from shared.engines import vllm_pd, vllm_process  # noqa: E402
from shared.engines.registry import make_engine  # noqa: E402
from shared.settings import Settings  # noqa: E402


def config_for(model_dir, stages=("prefill", "decode"), **changes):
    engine = make_engine("vllm", Settings(model=str(model_dir), engine="vllm", **changes), model_dir, stages)
    return engine, vllm_process.engine_config({}, engine.engine_args())


def test_every_knob_reaches_vllms_config(model_dir):
    # dtype bfloat16: the online int8 method wants it; tensor parallel 2 and CUDA graphs are refused on CPU at
    # start (tests/unit/test_vllm_settings.py), but vLLM's config builder takes them here: they are passed on
    _, c = config_for(model_dir, dtype="bfloat16", vllm_max_model_len_tokens=1024, vllm_gpu_memory_utilization=0.5,
                      vllm_max_num_seqs=6, vllm_max_num_batched_tokens=1024, vllm_tensor_parallel_size=2,
                      vllm_quantization="int8_per_channel_weight_only", vllm_kv_cache_dtype="bfloat16",
                      vllm_enforce_eager=False, vllm_enable_chunked_prefill=False, vllm_enable_prefix_caching=False,
                      max_media_items=12, max_images_per_request=3)
    assert c.model_config.max_model_len == 1024
    assert (c.cache_config.gpu_memory_utilization, c.cache_config.cache_dtype) == (0.5, "bfloat16")
    assert c.cache_config.enable_prefix_caching is False
    sched = c.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.enable_chunked_prefill) == (6, 1024, False)
    assert c.parallel_config.tensor_parallel_size == 2
    assert c.model_config.quantization == "int8_per_channel_weight_only"
    assert c.model_config.enforce_eager is False and c.compilation_config.mode != CompilationMode.NONE
    limits = c.model_config.multimodal_config.limit_per_prompt
    assert {m: o.count for m, o in limits.items()} == {"image": 3, "video": 12}  # above vLLM's old fixed 8


def test_defaults_are_vllms_own_and_eager_on_cpu(model_dir):
    engine, c = config_for(model_dir)
    assert c.model_config.max_model_len == engine.max_model_len == 4096  # the model's context
    assert c.model_config.enforce_eager is True and c.compilation_config.mode == CompilationMode.NONE  # auto, CPU
    assert c.cache_config.enable_prefix_caching is True and c.cache_config.cache_dtype == "auto"
    assert c.parallel_config.tensor_parallel_size == 1 and c.model_config.quantization is None
    assert c.cache_config.gpu_memory_utilization == CacheConfig().gpu_memory_utilization
    assert c.scheduler_config.max_num_seqs == SchedulerConfig.DEFAULT_MAX_NUM_SEQS
    assert c.scheduler_config.enable_chunked_prefill is True  # vLLM's choice for Qwen2-VL
    assert {m: o.count for m, o in c.model_config.multimodal_config.limit_per_prompt.items()} == \
        {"image": 8, "video": 8}


def test_a_decode_worker_apart_keeps_prefix_caching_off(model_dir):
    engine = make_engine("vllm", Settings(model=str(model_dir), engine="vllm"), model_dir, ("decode",))
    args = engine.engine_args()
    assert args["enable_prefix_caching"] is False and args["kv_transfer_config"].kv_role == vllm_pd.CONSUMER
    producer = make_engine("vllm", Settings(model=str(model_dir), engine="vllm", vllm_enable_prefix_caching=False),
                           model_dir, ("prefill",))
    assert producer.engine_args()["enable_prefix_caching"] is False
