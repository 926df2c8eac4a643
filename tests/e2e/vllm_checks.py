"""What a vLLM fleet must answer, checked against vLLM's own offline ``LLM.generate`` on the raw
media (tests/vllm_offline.py): the same greedy text for every prompt of a family (images, a
video with its sampled fps), and, for a request naming no sampling field, the same tokens and
length as vLLM with the model's generation config. The model folder is a copy of the tiny build
whose generation config sets sampling defaults (greedy through ``top_k=1``, so deterministic)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from shared.media.video import VideoClip, VideoLimits, decode_video_clip
from shared.settings import Settings
from tests.e2e.test_skeleton import png_data_url
from tests.media import samples
from tests.vllm_offline import Case, start_offline

# temperature and top_p would sample; top_k=1 keeps it greedy, so both sides are deterministic
GENERATION = {"temperature": 0.9, "top_p": 0.8, "top_k": 1, "max_new_tokens": 7, "do_sample": True}
DEFAULTS_TEXT = "Tell me about the moon and the stars."


def tuned_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` linked file by file into ``out``, its generation config given :data:`GENERATION`."""
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    return out


def clip() -> tuple[bytes, VideoClip]:
    """An MP4 and the frames media-fetch samples from it under the default settings (8 of 16)."""
    s = Settings()
    raw = samples.video(samples.video_frames(16, size=(96, 64), seed=5), fps=8)
    return raw, decode_video_clip(raw, num_frames=s.video_num_frames, fps=0, param="p",
                                  limits=VideoLimits(s.max_video_duration_s, s.max_video_frames, s.max_video_side,
                                                     s.max_video_decoded_frames))


def request_content(case: Case, raw_videos: list[bytes]) -> str | list[dict]:
    """The OpenAI message content for ``case``: images, then videos, then the text."""
    if not case["images"] and not case["videos"]:
        return case["text"]
    return [*({"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in case["images"]),
            *({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(r).decode()}}
              for r in raw_videos),
            {"type": "text", "text": case["text"]}]


class Expected:
    """vLLM's offline answers for ``cases`` (+ a no-sampling-fields text case): started at once in a
    subprocess, read when first needed, so the reference runs while a fleet starts; ``close``
    ends a run nobody read."""

    def __init__(self, model_dir: Path, cases: dict[str, tuple[Case, list[bytes]]], work: Path) -> None:
        self.model_dir, self.cases = model_dir, cases
        self._offline = start_offline(model_dir, {**{n: c for n, (c, _) in cases.items()},
                                                  "defaults": Case(DEFAULTS_TEXT)}, work)
        self._answers: dict[str, dict] | None = None
        self._texts: dict[str, str] = {}

    @property
    def answers(self) -> dict[str, dict]:
        if self._answers is None:
            from transformers import AutoTokenizer

            answers = self._offline.answers()
            tok = AutoTokenizer.from_pretrained(self.model_dir)
            # as the gateway detokenizes: the whole completion at once, special tokens skipped
            self._texts = {n: tok.decode(a["token_ids"], skip_special_tokens=True) for n, a in answers.items()}
            default = answers["defaults"]
            assert (default["finish_reason"], len(default["token_ids"])) == ("length", GENERATION["max_new_tokens"]), \
                f"vLLM did not take max_new_tokens from the generation config: {default}"
            for name, answer in answers.items():
                assert len(set(answer["token_ids"])) > 1, f"{name}: degenerate model, one token repeated"
            self._answers = answers
        return self._answers

    @property
    def texts(self) -> dict[str, str]:
        self.answers  # noqa: B018 - read once, on first use
        return self._texts

    def close(self) -> None:
        self._offline.kill()

    def check_fleet(self, client, label: str) -> None:
        """Every greedy case, whole and streamed, then the request with no sampling fields."""
        for name, (case, raw) in self.cases.items():
            kwargs = dict(model="mmfleet-demo", temperature=0, max_tokens=case["max_tokens"],
                          messages=[{"role": "user", "content": request_content(case, raw)}])
            whole = client.chat.completions.create(**kwargs).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(stream=True, **kwargs) if c.choices)
            assert whole == self.texts[name], f"{label}/{name}: fleet and vLLM offline differ"
            assert streamed == self.texts[name], f"{label}/{name} (stream): fleet and vLLM offline differ"
        out = client.chat.completions.create(model="mmfleet-demo",
                                             messages=[{"role": "user", "content": DEFAULTS_TEXT}])
        expected = self.answers["defaults"]
        got = (out.choices[0].message.content, out.usage.completion_tokens, out.choices[0].finish_reason)
        assert got == (self.texts["defaults"], len(expected["token_ids"]), expected["finish_reason"]), \
            f"{label}: a request without sampling fields got {got}, vLLM with the generation config {expected}"
