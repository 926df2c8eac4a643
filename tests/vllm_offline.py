"""vLLM's own answer, as ``vllm serve`` would give it: ``vllm.LLM(model_dir).generate`` on the
chat-templated prompt with the RAW media (vLLM runs its own processor: resizing, patching, the
video's time step from the clip's fps). Run as a subprocess (:func:`offline_answers`): an engine
core in the test process would outlive fleets and hold its memory. Greedy cases set
``temperature=0`` and ``max_tokens``; ``defaults`` cases take the model's generation config,
as a request without sampling fields does (``LLM.get_default_sampling_params``).

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


class Case(dict):
    """One prompt: ``text`` (the user's words), ``images`` (PIL), ``videos`` ((frames, sampled
    fps)), ``max_tokens`` (0: the model's generation-config defaults, nothing else set)."""

    def __init__(self, text: str, images=(), videos=(), max_tokens: int = 0) -> None:
        super().__init__(text=text, images=list(images), videos=list(videos), max_tokens=max_tokens)


def offline_answers(model_dir: Path, cases: dict[str, Case], work: Path, timeout_s: float = 600) -> dict[str, dict]:
    """name → {"token_ids", "text", "finish_reason"} from vLLM in a subprocess (its log in ``work``)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model_dir": str(model_dir), "cases": {}}
    for name, case in cases.items():
        imgs = []
        for i, im in enumerate(case["images"]):
            imgs.append(str(work / f"{name}-{i}.png"))
            im.save(imgs[-1])
        vids = []
        for i, (frames, fps) in enumerate(case["videos"]):
            vids.append({"frames": str(work / f"{name}-{i}.npy"), "fps": float(fps)})
            np.save(vids[-1]["frames"], frames)
        spec["cases"][name] = {"text": case["text"], "images": imgs, "videos": vids, "max_tokens": case["max_tokens"]}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(work / "vllm-offline.log", "wb") as log:
        subprocess.run([sys.executable, "-m", "tests.vllm_offline", str(work / "spec.json"), str(work / "out.json")],
                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    out = work / "out.json"
    if not out.exists():
        log_tail = (work / "vllm-offline.log").read_text()[-4000:]
        raise RuntimeError(f"vLLM offline run wrote no answers; its log:\n{log_tail}")
    return json.loads(out.read_text())


def _messages(case: dict) -> list[dict]:
    parts = [{"type": "image"} for _ in case["images"]] + [{"type": "video"} for _ in case["videos"]]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": case["text"]}]}]


def _video_item(v: dict):
    frames = np.load(v["frames"])
    n = len(frames)
    # the frames as sampled, at their own rate: vLLM's processor must not sample them again
    return frames, {"fps": v["fps"], "duration": n / v["fps"], "total_num_frames": n,
                    "frames_indices": list(range(n)), "video_backend": "pyav", "do_sample_frames": False}


def main(spec_path: str, out_path: str) -> None:
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    model_dir = spec["model_dir"]
    processor = AutoProcessor.from_pretrained(model_dir)
    cases = spec["cases"]
    most = max(max(len(c["images"]), len(c["videos"])) for c in cases.values()) or 1
    llm = LLM(model=model_dir, dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              limit_mm_per_prompt={"image": most, "video": most}, disable_log_stats=True)
    out = {}
    for name, case in cases.items():
        prompt: dict = {"prompt": processor.apply_chat_template(_messages(case), tokenize=False,
                                                                add_generation_prompt=True)}
        data = {}
        if case["images"]:
            data["image"] = [Image.open(p).convert("RGB") for p in case["images"]]
        if case["videos"]:
            data["video"] = [_video_item(v) for v in case["videos"]]
        if data:
            prompt["multi_modal_data"] = data
        if case["max_tokens"]:
            params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])
        else:
            params = llm.get_default_sampling_params()
        result = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out[name] = {"token_ids": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
