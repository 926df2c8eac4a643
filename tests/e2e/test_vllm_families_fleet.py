"""LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video and Qwen2-Audio through a vLLM fleet, against vLLM's
own offline ``LLM.generate`` on the same checkpoint, prompt and media bytes (``vllm_offline``,
raw media through vLLM's processor and encoder): the fleet's greedy text must equal it. One
fleet per family serves all its cases. LLaVA and Qwen2-Audio go as our encoder's embeddings, in
e-p-d (the KV moved from prefill's vLLM to decode's); LLaVA-NeXT and LLaVA-NeXT-Video by the
raw-media path, in e-p-d (the decoded images cross from the encode worker to prefill's vLLM over
NIXL) and ep-d (the frames stay in the encode+prefill worker). The epd layout of each family is
covered at engine level (tests/engines/test_vllm_families.py). The reference runs while the
fleet starts.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import openai
import pytest
from PIL import Image

from shared.models.registry import DEMOS
from tests import procs
from tests.conftest import CACHE_DIR
from tests.media import samples

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")

MAX_TOKENS = 8
MIME = {"image": "image/png", "video": "video/mp4"}


def _png(seed: int, size: tuple[int, int]) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _video(seed: int) -> bytes:
    return samples.video(samples.video_frames(16, size=(96, 64), seed=seed), fps=8)


def _wav(freq: float, seconds: float) -> bytes:
    return samples.wav(seconds, rate=44_100, freq=freq)


# family -> (mode, case -> (media items (kind, bytes, num_frames), question))
FAMILIES = {
    "llava": ("e-p-d", {
        "text": ([], "Say something."),
        "one_image": ([("image", _png(1, (90, 60)), 0)], "What is in the image?"),
        "two_images": ([("image", _png(2, (60, 90)), 0), ("image", _png(3, (120, 80)), 0)], "Compare them."),
    }),
    "llava_next": ("e-p-d", {  # 5 and 3 anyres tiles
        "one_image": ([("image", _png(1, (90, 60)), 0)], "What is in the image?"),
        "two_images": ([("image", _png(2, (200, 200)), 0), ("image", _png(3, (60, 130)), 0)], "Compare them."),
    }),
    "llava_next_video": ("ep-d", {
        "default_frames": ([("video", _video(5), 0)], "What happens in the video?"),
        "three_frames": ([("video", _video(6), 3)], "What happens?"),
    }),
    "qwen2_audio": ("e-p-d", {
        "one_clip": ([("audio", _wav(440.0, 0.5), 0)], "What is this sound?"),
        "two_clips": ([("audio", _wav(2000.0, 1.5), 0), ("audio", _wav(300.0, 1.0), 0)], "Which is higher?"),
    }),
}


def _openai_part(kind: str, raw: bytes, num_frames: int) -> dict:
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}}
    url = {"url": f"data:{MIME[kind]};base64," + base64.b64encode(raw).decode()}
    if num_frames:
        url["num_frames"] = num_frames
    return {"type": f"{kind}_url", f"{kind}_url": url}


def _reference_spec(model_dir, cases: dict, tmp) -> dict:
    """The offline reference's cases: the same items as files, the template's part types."""
    spec_cases = {}
    for name, (items, question) in cases.items():
        parts = []
        for i, (kind, raw, num_frames) in enumerate(items):
            path = tmp / f"{name}-{i}.{kind}"
            path.write_bytes(raw)
            parts.append({"type": kind, "path": str(path), "num_frames": num_frames})
        spec_cases[name] = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    return {"model": str(model_dir), "max_tokens": MAX_TOKENS, "cases": spec_cases}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fleet_equals_vllm_offline(family, kafka_bootstrap, redis_url, tmp_path):
    mode, cases = FAMILIES[family]
    model_dir = DEMOS[family.replace("_", "-")](CACHE_DIR / "models")
    spec, out = tmp_path / "spec.json", tmp_path / "expected.json"
    spec.write_text(json.dumps(_reference_spec(model_dir, cases, tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMFLEET_")}
    with open(tmp_path / "offline.log", "wb") as log:  # its own process group: its engine core goes with it
        reference = subprocess.Popen([sys.executable, "-m", "tests.e2e.vllm_offline", str(spec), str(out)],
                                     cwd=procs.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    try:
        env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
               "MMFLEET_ENGINE": "vllm", "MMFLEET_REDIS_PREFIX": f"vllm-{family}",
               "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024)}
        answers = {}
        (tmp_path / "fleet").mkdir()
        with procs.fleet(env, tmp_path / "fleet", mode=mode, ready_timeout_s=300) as (base, _proc):
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            for name, (items, question) in cases.items():
                kwargs = dict(model="mmfleet-demo", temperature=0, max_tokens=MAX_TOKENS, messages=[
                    {"role": "user", "content": [*(_openai_part(*it) for it in items),
                                                 {"type": "text", "text": question}]}])
                answers[name] = client.chat.completions.create(**kwargs).choices[0].message.content
                if name == next(iter(cases)):
                    answers[name + " (stream)"] = "".join(
                        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                        if c.choices)
            if family == "llava_next_video":  # vLLM's model takes one video per prompt: a 400, as vllm serve's
                items, question = cases["default_frames"]
                with pytest.raises(openai.BadRequestError, match="2 video items; this server takes at most 1"):
                    client.chat.completions.create(model="mmfleet-demo", max_tokens=2, messages=[
                        {"role": "user", "content": [*(_openai_part(*it) for it in items * 2),
                                                     {"type": "text", "text": question}]}])
        assert reference.wait(timeout=600) == 0, (tmp_path / "offline.log").read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reference.pid, signal.SIGKILL)  # the group it leads: any engine core left behind
        reference.wait()
    expected = json.loads(out.read_text())
    assert len(set(expected.values())) > 1, f"{family}: degenerate model, every case answered alike"
    assert answers == {**expected, **{k + " (stream)": expected[k] for k in list(cases)[:1]}}
