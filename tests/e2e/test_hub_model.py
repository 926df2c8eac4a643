"""Serving by hub id: the tiny model laid out as the hub keeps a VLM repository
(bf16 sharded safetensors + index, preprocessor_config.json, the processor's template in
chat_template.json apart from the tokenizer's) in a hub cache of its own, served by ``mmfleet
up`` in e-p-d as ``MMFLEET_MODEL=<id>`` with ``HF_HUB_OFFLINE=1``: the fleet answers to the id,
its greedy text equals ``generate()`` on the same snapshot, the encode worker holds no LM weight,
and an id not in the cache stops ``mmfleet up`` naming the id and the cache."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
from PIL import Image

from services.modes import MODES
from shared.models.reference import reference_generate
from tests import procs
from tests.hubcache import REPO_ID, build_hub_cache

MAX_TOKENS = 10
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def hub(model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub-e2e") / "hub"
    return cache, build_hub_cache(model_dir, cache)


@pytest.fixture(scope="module")
def served(kafka_bootstrap, redis_url, hub, tmp_path_factory):
    cache, _ = hub
    logs = tmp_path_factory.mktemp("hub-fleet-logs")
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL": REPO_ID,
           "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024),
           "MMFLEET_REDIS_PREFIX": "hub"}
    with procs.fleet(env, logs) as (base, _proc):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), logs


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_served_by_id_equal_to_generate(served, hub):
    from transformers import AutoTokenizer

    client, _ = served
    _, snapshot = hub
    assert [m.id for m in client.models.list().data] == [REPO_ID]  # served_model_name follows the id
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = reference_generate(snapshot, messages, [img], MAX_TOKENS)  # bf16, the processor's template
    expected = AutoTokenizer.from_pretrained(snapshot).decode(ids, skip_special_tokens=True)
    reply = client.chat.completions.create(model=REPO_ID, temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                     {"type": "text", "text": QUESTION}]}])
    assert reply.choices[0].message.content == expected
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="mmfleet-demo", max_tokens=2, messages=[{"role": "user", "content": "x"}])


def test_encode_worker_holds_no_lm_weights(served):
    _, logs = served
    encode_worker = "+".join(next(g for g in MODES["e-p-d"] if "encode" in g))  # its log: the supervisor's name
    lines = [ln for ln in (logs / f"{encode_worker}.log").read_text().splitlines() if "model loaded:" in ln]
    assert lines and all("bfloat16 weights" in ln and "LM 0.0 MiB" in ln for ln in lines), lines
    prefill = [ln for ln in (logs / "prefill.log").read_text().splitlines() if "model loaded:" in ln]
    assert prefill and all("encoder 0.0 MiB" in ln for ln in prefill), prefill


def test_missing_id_stops_up_naming_id_and_cache(hub):
    cache, _ = hub
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMFLEET_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", "mmfleet-test/absent",
                        "--kafka-bootstrap", f"127.0.0.1:{procs.free_port()}"],
                       cwd=procs.REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "mmfleet up: cannot start: model 'mmfleet-test/absent'" in r.stderr and str(cache) in r.stderr, r.stderr
