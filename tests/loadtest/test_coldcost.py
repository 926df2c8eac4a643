"""``python -m loadtest cold``: a prefill forward's CPU cost hot and cold, on the tiny model
(cheap: a short prompt, few forwards). The figures themselves are benchmark results (docs/benchmarks/),
never asserted here; that every condition is measured, consistently, and written out is."""

from __future__ import annotations

import json
import os

import pytest

from loadtest import coldcost
from shared.engines.transformers_engine import compute_class
from shared.models.loading import LM


def test_measure_reports_every_condition_consistently(model_dir):
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    res = coldcost.measure(compute, prompt_tokens=12, forwards=3, repeats=2, idle_ms=2, pressure_bytes=2**20)
    assert res["conditions"] == list(coldcost.CONDITIONS)
    assert all(len(res["runs"][c]) == 2 for c in coldcost.CONDITIONS)
    for runs in res["runs"].values():
        for run in runs:
            assert run["cpu_ms"] > 0 and run["wall_ms"] > 0
    for c, runs in res["runs"].items():
        for i, run in enumerate(runs):  # against the hot forwards of the same repeat
            assert run["vs_hot"] == pytest.approx(run["cpu_ms"] / res["runs"]["hot"][i]["cpu_ms"])
    for stats in res["by_condition"].values():
        assert all(s["min"] <= s["median"] <= s["max"] for s in stats.values())
    assert res["by_condition"]["hot"]["vs_hot"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    table = coldcost.markdown(res).splitlines()
    assert len(table) == 2 + len(coldcost.CONDITIONS) and table[2].startswith("| nothing (back to back) |")


def test_a_sleep_before_each_forward_shows_in_wall_time_not_in_cpu(model_dir):
    """The sleep is outside the timed forward: the idle condition's wall time per forward does
    not contain it (a timing window misplaced around the sleep would add ~idle_ms)."""
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    res = coldcost.measure(compute, prompt_tokens=8, forwards=3, repeats=1, idle_ms=200, pressure_bytes=0)
    assert res["by_condition"]["idle"]["wall_ms"]["median"] < 150


def _on_cpu_or_runnable_s() -> float:
    """This thread's time running plus waiting to run (``/proc/thread-self/schedstat``): a thread
    that never sleeps accrues its wall time here however loaded the machine is."""
    run_ns, wait_ns, _ = open("/proc/thread-self/schedstat").read().split()
    return (int(run_ns) + int(wait_ns)) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no per-thread schedstat here")
def test_the_busy_condition_waits_on_the_cpu_outside_the_timed_forward(model_dir):
    """``busy`` spends ``idle_ms`` before each forward without sleeping (the thread is running or
    runnable throughout: CPU time alone would read short on a loaded machine) and, like the
    sleep, outside the timed forward."""
    compute = compute_class(model_dir)(model_dir, parts=frozenset({LM}))
    s0 = _on_cpu_or_runnable_s()
    res = coldcost.measure(compute, prompt_tokens=8, forwards=3, repeats=1, idle_ms=200, pressure_bytes=0)
    # the three busy-waits at least; the two sleeping conditions' 3 × 2 × 200 ms are not counted
    assert _on_cpu_or_runnable_s() - s0 >= 3 * 0.2 * 0.9
    assert res["by_condition"]["busy"]["wall_ms"]["median"] < 150


def test_the_command_writes_its_json(model_dir, tmp_path, capsys):
    assert coldcost.main(["--model-dir", str(model_dir), "--prompt-tokens", "8", "--forwards", "2", "--repeats", "1",
                          "--idle-ms", "1", "--pressure-bytes", "65536", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "cold.json").read_text())
    assert res["conditions"] == list(coldcost.CONDITIONS) and res["model_dir"] == str(model_dir)
    assert "| a 1 ms sleep |" in capsys.readouterr().out


def test_bad_arguments_are_refused(model_dir):
    with pytest.raises(SystemExit, match="--forwards"):
        coldcost.main(["--model-dir", str(model_dir), "--forwards", "0"])
