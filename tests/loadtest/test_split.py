"""``python -m loadtest split``: the in-process encode / prefill / decode measurement, on the tiny
model (cheap: one repeat, short prompts). What it measures for the bench model is a benchmark
figure (docs/benchmarks/), never asserted here."""

from __future__ import annotations

import torch
from transformers import Qwen2VLForConditionalGeneration

from loadtest import split


def test_measure_reports_every_part_and_consistent_ratios(model_dir):
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res = split.measure(model, device="cpu", image_side=448, text_tokens=16, long_tokens=96, decode_tokens=3,
                        repeats=2, cached_tokens=64)
    assert (res["image_tokens"], res["prompt_tokens"], len(res["runs"])) == (256, 272, 2)
    for run in res["runs"]:
        assert all(run[k] > 0 for k in ("encode_ms", "prefill_ms", "decode_ms_per_token", "long_prefill_ms"))
        assert run["ttft_ms"] == run["encode_ms"] + run["prefill_ms"]
        assert abs(run["encode_share"] - run["encode_ms"] / run["ttft_ms"]) < 1e-9
        assert run["suffix_prefill_ms"] > 0
        assert abs(run["long_over_suffix"] - run["long_prefill_ms"] / run["suffix_prefill_ms"]) < 1e-9
    assert res["cached_tokens"] == 64
    s = res["summary"]["encode_share"]
    assert s["min"] <= s["median"] <= s["max"] < 1
    assert res["params"]["vision"] > 0 and res["params"]["language"] > 0
    row = split.markdown("tiny", "cpu", res)
    assert row.startswith("| tiny | cpu |") and row.count("|") == split.header(96).splitlines()[0].count("|")

