"""The sliding-window suite's parts: the workload (each turn the last W images of the user's
stream, one new a turn), the sessions load shape (a user's turns one after another, users at
once), the dataset vLLM's client replays (read back by vLLM's own loader), and the figures and
goals computed from runs."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from loadtest import window, window_dataset, workloads
from loadtest.client import RequestRecord
from loadtest.loadgen import LoadShape, drive


def _build(users=3, turns=4, w=4, seed=0):
    return workloads.build(window.default_workload(users, turns, w, side=32, words=5, max_tokens=4, seed=seed))


def test_each_turn_drops_the_oldest_image_and_adds_one_new():
    specs = _build()
    assert [(s.session, s.turn) for s in specs[:4]] == [(0, 0), (1, 0), (2, 0), (0, 1)]  # turn-major
    for sess in workloads.sessions_of(specs):
        imgs = [specs[k].images for k in sess]
        assert all(len(x) == 4 and len(specs[k].messages) == 1 for x, k in zip(imgs, sess))
        for prev, cur in zip(imgs, imgs[1:]):
            assert cur[:3] == prev[1:] and cur[3] not in prev  # slid by one: 3 of 4 seen, never in place
    users = [{i for k in sess for i in specs[k].images} for sess in workloads.sessions_of(specs)]
    assert all(not (a & b) for n, a in enumerate(users) for b in users[n + 1:])  # no image shared by users
    assert len(users[0]) == 4 + 3
    assert _build(seed=1) != specs and _build() == specs


def test_sessions_of_groups_turns_in_order_and_lone_requests_apart():
    specs = _build(users=2, turns=3)
    assert workloads.sessions_of(specs) == [[0, 2, 4], [1, 3, 5]]
    plain = workloads.build(workloads.WorkloadConfig(kind="image", num_requests=3))
    assert workloads.sessions_of(plain) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="window >= 1"):
        workloads.build(workloads.WorkloadConfig(kind="sliding-window", num_requests=2, window=0))


async def test_a_users_turns_never_overlap_and_users_run_at_once():
    specs = _build(users=3, turns=4)
    spans: dict[int, tuple[float, float]] = {}
    in_flight, peak = 0, 0

    async def send(i: int, t0: float) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        start = time.perf_counter()
        await asyncio.sleep(0.01 * (1 + i % 3))  # uneven: a turn-major closed loop would overlap a user's turns
        spans[i] = (start, time.perf_counter())
        in_flight -= 1
        return RequestRecord(index=i, status=200, e2e_ms=10.0, start_s=start - t0)

    records, timing = await drive(LoadShape("sessions", 3, 100, duration_s=30), send,
                                  sessions=workloads.sessions_of(specs))
    assert len(records) == len(specs) and timing.stopped_by == "count" and peak == 3
    for sess in workloads.sessions_of(specs):
        for a, b in zip(sess, sess[1:]):
            assert spans[a][1] <= spans[b][0], "a turn started before the previous one answered"
    few, _ = await drive(LoadShape("sessions", 2, 5, duration_s=30), send, sessions=workloads.sessions_of(specs))
    assert len(few) == 5
    with pytest.raises(ValueError, match="needs the workload's sessions"):
        await drive(LoadShape("sessions", 2, 5), send)


def test_vllms_own_loader_reads_the_dataset(tmp_path):
    specs = _build(users=2, turns=3)
    path = window_dataset.write(specs, tmp_path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 6 and len(list((tmp_path / "images").iterdir())) == 2 * (4 + 2)
    assert lines[0]["prompt"] == specs[0].messages[0].text and lines[0]["output_tokens"] == 4
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    from transformers import AutoTokenizer

    from shared.models.qwen2_vl_tiny import ensure_tiny_qwen2_vl
    from tests.conftest import CACHE_DIR

    tok = AutoTokenizer.from_pretrained(ensure_tiny_qwen2_vl(CACHE_DIR / "models"))
    ds = datasets.CustomImageDataset(dataset_path=str(path), disable_shuffle=True, random_seed=0)
    got = ds.sample(tokenizer=tok, num_requests=6, output_len=4, ensure_client_side_data=True)
    assert len(got) == 6 and all(len(r.multi_modal_data) == 4 for r in got)
    assert all(p["image_url"]["url"].startswith("data:image/") for p in got[0].multi_modal_data)
    assert [r.prompt for r in got] == [s.messages[0].text for s in specs]  # our order (turn-major), kept
    argv = window_dataset.client_argv("http://h:1", path, model="m", tokenizer=tmp_path, users=2, num_prompts=6,
                                      output_len=4, result_dir=tmp_path, result_file="r.json")
    assert argv[argv.index("--custom-output-len") + 1] == "4" and "--disable-shuffle" in argv


def _run(target, rep, ttfts, turns, encoded=None, rps=1.0):
    recs = [{"index": i, "ttft_ms": t, "error": None} for i, t in enumerate(ttfts)]
    agg = {"ok": len(recs), "requests": len(recs), "failed": 0, "request_throughput": rps, "output_throughput": 1.0,
           "ttft_ms": {"p50": sorted(ttfts)[len(ttfts) // 2], "p90": max(ttfts), "p99": max(ttfts),
                       "mean": sum(ttfts) / len(ttfts)}, "itl_ms": {"p50": 5.0}}
    return {"target": target, "repeat": rep, "aggregates": agg, "records": recs, "turns": turns,
            "encoder_items": encoded, "image_slots": 4 * len(ttfts)}


def test_figures_and_goals_from_runs():
    turns = [0, 0, 1, 1]
    runs = [_run(window.FLEET, r, [400, 500, 100 + r, 120], turns, encoded=10, rps=3.0) for r in range(3)]
    runs += [_run(window.VLLM, r, [900, 1000, 800, 850 + r], turns, rps=1.0) for r in range(3)]
    rows = window.per_target({"runs": runs})
    fleet = rows[window.FLEET]
    assert fleet["cold_ttft_ms:p50"] == (450, 450, 450) and fleet["followup_ttft_ms:p50"] == (110.5, 110, 111)
    assert fleet["encoder_items_per_request"][0] == 2.5 and fleet["hit_rate"][0] == pytest.approx(1 - 10 / 16)
    assert rows[window.VLLM]["hit_rate"] is None
    by_goal = [g["verdict"] for g in window.goals(rows)]
    # p50 0.32x (not <= 0.25), mean 0.29x, p90 0.5x, RPS 3x
    assert by_goal == ["**not met**", "met", "met", "met"]
    assert window.goals({window.FLEET: fleet})[0]["verdict"].startswith("not evaluated")
    assert len(window.table_rows(rows)[0]) == len(window.COLUMNS)


def test_cpu_per_request_by_process_and_the_cores_kept_busy(monkeypatch):
    monkeypatch.setattr(window.os, "cpu_count", lambda: 2)
    runs = []
    for rep, prefill_s in enumerate((3.0, 2.0, 4.0)):  # 10 requests over a 5 s window each round
        run = _run(window.FLEET, rep, [100] * 10, [0] * 10)
        run["cpu"] = {"by_process_s": {"worker prefill": prefill_s, "gateway": 0.5, "zygote": 0.0}, "window_s": 5.0,
                      "by_thread_s": {"worker prefill": {"compute": prefill_s - 1, "event loop": 1.0},
                                      "gateway": {"event loop": 0.5}}}
        runs.append(run)
    runs.append(_run(window.VLLM, 0, [100] * 10, [0] * 10))  # no CPU accounting: no rows
    rows = window.cpu_rows({"runs": runs})
    assert rows == [["`fleet:e-p-d`", "worker prefill", "300 (200–400)", "200 (100–300)", ""],
                    ["`fleet:e-p-d`", "gateway", "50", "–", ""],
                    ["`fleet:e-p-d`", "**all**", "350 (250–450)", "200 (100–300)", "35%"]]
    assert all(len(r) == len(window.CPU_COLUMNS) for r in rows)
