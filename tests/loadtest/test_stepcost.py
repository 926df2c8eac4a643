"""``python -m loadtest steps``: a batched decode step's CPU cost by width, on the tiny model
(cheap: short prompts, few steps). The figures themselves are benchmark results (docs/benchmarks/), never
asserted here; that every width is measured, consistently, and written out is."""

from __future__ import annotations

import json

from loadtest import stepcost
from shared.engines.transformers_engine import compute_class
from shared.models.loading import LM


def test_measure_reports_every_width_consistently(model_dir):
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    res = stepcost.measure(compute, widths=[1, 3], prompt_tokens=16, steps=3, repeats=2)
    assert list(res["by_width"]) == ["1", "3"] and all(len(res["runs"][w]) == 2 for w in ("1", "3"))
    for w, runs in res["runs"].items():
        for run in runs:
            assert run["step_ms"] > 0 and run["join_step_ms"] > 0
            assert abs(run["per_seq_ms"] - run["step_ms"] / int(w)) < 1e-9
    for stats in res["by_width"].values():
        assert all(s["min"] <= s["median"] <= s["max"] for s in stats.values())
    table = stepcost.markdown(res).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| 1 |") and table[3].startswith("| 3 |")


def test_the_command_writes_its_json(model_dir, tmp_path, capsys):
    assert stepcost.main(["--model-dir", str(model_dir), "--widths", "2", "--prompt-tokens", "8", "--steps", "2",
                          "--repeats", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "steps.json").read_text())
    assert res["widths"] == [2] and res["model_dir"] == str(model_dir)
    assert "| 2 |" in capsys.readouterr().out
