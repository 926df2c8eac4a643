"""vLLM's own answer, as ``vllm serve`` would give it: ``vllm.LLM(model_dir).generate`` on the
chat-templated prompt (its token ids, as the server renders them) with the RAW media (vLLM runs
its own processor: resizing, patching, the video's time step from the clip's fps). Run as a
subprocess (:func:`start_offline`, :func:`offline_answers`): an engine core in the test process
would outlive fleets and hold its memory. Greedy cases set ``temperature=0`` and ``max_tokens``;
``defaults`` cases take the model's generation config, as a request without sampling fields does
(``LLM.get_default_sampling_params``). Media are decoded by the caller as media-fetch decodes them.

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


class Case(dict):
    """One prompt: ``text`` (the user's words), ``images`` (PIL), ``videos`` ((frames, sampled
    fps), fps None: the frames alone, for models that take no video metadata), ``audios``
    ((samples, rate)), ``max_tokens`` (0: the model's generation-config defaults, nothing else set)."""

    def __init__(self, text: str, images=(), videos=(), audios=(), max_tokens: int = 0) -> None:
        super().__init__(text=text, images=list(images), videos=list(videos), audios=list(audios),
                         max_tokens=max_tokens)


class Offline:
    """A running reference (:func:`start_offline`); :meth:`answers` waits for it."""

    def __init__(self, proc: subprocess.Popen, work: Path) -> None:
        self._proc, self._work = proc, work

    def answers(self, timeout_s: float = 600) -> dict[str, dict]:
        """name → {"token_ids", "text", "finish_reason"}."""
        try:
            code = self._proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        out = self._work / "out.json"
        if code != 0 or not out.exists():
            log_tail = (self._work / "vllm-offline.log").read_text()[-4000:]
            raise RuntimeError(f"vLLM offline run exited {code} and wrote no answers; its log:\n{log_tail}")
        return json.loads(out.read_text())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # the group it leads: any engine core left behind
        self._proc.wait()


def start_offline(model_dir: Path, cases: dict[str, Case], work: Path) -> Offline:
    """vLLM on ``cases`` in a subprocess of its own process group (its log in ``work``)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model_dir": str(model_dir), "cases": {}}
    for name, case in cases.items():
        imgs = []
        for i, im in enumerate(case["images"]):
            imgs.append(str(work / f"{name}-{i}.png"))
            im.save(imgs[-1])
        vids = []
        for i, (frames, fps) in enumerate(case["videos"]):
            vids.append({"frames": str(work / f"{name}-v{i}.npy"), "fps": None if fps is None else float(fps)})
            np.save(vids[-1]["frames"], frames)
        auds = []
        for i, (samples, rate) in enumerate(case["audios"]):
            auds.append({"samples": str(work / f"{name}-a{i}.npy"), "rate": int(rate)})
            np.save(auds[-1]["samples"], samples)
        spec["cases"][name] = {"text": case["text"], "images": imgs, "videos": vids, "audios": auds,
                               "max_tokens": case["max_tokens"]}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMFLEET_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    with open(work / "vllm-offline.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_offline", str(work / "spec.json"),
                                 str(work / "out.json")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Offline(proc, work)


def offline_answers(model_dir: Path, cases: dict[str, Case], work: Path, timeout_s: float = 600) -> dict[str, dict]:
    return start_offline(model_dir, cases, work).answers(timeout_s)


def _messages(case: dict) -> list[dict]:
    parts = [{"type": kind} for kind in ("image", "video", "audio") for _ in case[kind + "s"]]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": case["text"]}]}]


def _video_item(v: dict):
    frames = np.load(v["frames"])
    if v["fps"] is None:
        return frames
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
    limits = {kind: max(len(c[kind + "s"]) for c in cases.values()) for kind in ("image", "video", "audio")}
    llm = LLM(model=model_dir, dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              limit_mm_per_prompt={k: n for k, n in limits.items() if n} or None, disable_log_stats=True)
    out = {}
    for name, case in cases.items():
        text = processor.apply_chat_template(_messages(case), tokenize=False, add_generation_prompt=True)
        # ids, not text: vLLM would add a BOS the template already wrote (LLaVA's tokenizer adds one)
        prompt: dict = {"prompt_token_ids": processor.tokenizer(text, add_special_tokens=False)["input_ids"]}
        data = {}
        if case["images"]:
            data["image"] = [Image.open(p).convert("RGB") for p in case["images"]]
        if case["videos"]:
            data["video"] = [_video_item(v) for v in case["videos"]]
        if case["audios"]:
            data["audio"] = [(np.load(a["samples"]), a["rate"]) for a in case["audios"]]
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
