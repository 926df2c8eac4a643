"""Operator readiness, end to end: one ``mmfleet up`` fleet (m-e-p-d: every stage a process of
its own, so each is found and scraped apart; JSON logs) serves a few
requests (text and image, streamed and whole, one bad image); then every process is found the
way an operator would find it (the gateway and each worker through their liveness records in
Redis), its ``/metrics`` is scraped, and the series the traffic must have moved are checked.
The logs are checked too: one request id is found in the gateway's and a stage's JSON lines.
The operator's view is checked on the same fleet: ``mmfleet top --once`` lists every stage and
process, and a real headless Chromium watches ``/fleet`` move under a few requests and show a
SIGKILLed worker as gone."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest
import redis.asyncio as aioredis
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from shared.keys import RedisKeys
from shared.transport.liveness import heartbeat, live_gateways, live_workers
from tests import browser, procs
from tests.e2e.test_skeleton import image_parts, noise_image, png_data_url

PREFIX = "obs"
STAGES = ("media-fetch", "encode", "prefill", "decode")
DOCS_SHOT = procs.REPO / "docs" / "guide" / "img" / "fleet-page.png"  # UPDATE_DOCS_SCREENSHOT=1 retakes it


@pytest.fixture(scope="module")
def obs_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("obs-logs")


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, redis_url, model_dir, obs_logs):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_POOL_BYTES": str(64 * 1024 * 1024), "MMFLEET_REDIS_PREFIX": PREFIX,
           "MMFLEET_LOG_FORMAT": "json"}
    with procs.fleet(env, obs_logs, mode="m-e-p-d") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def traffic(fleet):
    """Text and one image, whole and streamed, plus one bad image (a 400 from media-fetch)."""
    client = openai.OpenAI(base_url=fleet + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = []

    def chat(content, **kw):
        return client.chat.completions.create(model="mmfleet-demo", temperature=0, max_tokens=8,
                                              messages=[{"role": "user", "content": content}], **kw)

    # two different images: a repeated one would be an embedding-cache hit and skip encode
    images = [image_parts([png_data_url(noise_image(seed))], "What is this?") for seed in (5, 6)]
    for whole, streamed in (("Tell me about the sea.", "Tell me about the sea."), images):
        ids.append(chat(whole).id)
        chunks = list(chat(streamed, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ids.append(chunks[0].id)
    not_an_image = "data:image/png;base64,aGVsbG8sIEkgYW0gcGxhaW4gdGV4dA=="
    with pytest.raises(openai.BadRequestError):
        chat(image_parts([not_an_image], "What is this?"))
    return ids


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}; also checks the content type."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``; KeyError if none."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    if not hits:
        raise KeyError(f"no sample {name}{labels}")
    return sum(hits)


async def _endpoints(redis_url: str):
    redis = aioredis.from_url(redis_url)
    try:
        keys = RedisKeys(PREFIX)
        return await live_gateways(redis, keys), await live_workers(redis, keys)
    finally:
        await redis.aclose()


def test_every_process_exposes_its_metrics(fleet, traffic, redis_url):
    gateways, workers = asyncio.run(_endpoints(redis_url))
    assert [g.url.rsplit(":", 1)[1] for g in gateways] == [fleet.rsplit(":", 1)[1]]
    assert sorted(s for w in workers for s in w.stages) == sorted(STAGES)
    assert len({w.metrics_port for w in workers}) == len(workers) and all(w.metrics_port for w in workers)

    gw = scrape(fleet + "/metrics")
    assert value(gw, "mmfleet_requests_total", status="200") >= 4
    assert value(gw, "mmfleet_requests_total", status="400") >= 1
    assert value(gw, "mmfleet_ttft_seconds_count") >= 4
    assert value(gw, "mmfleet_ttft_seconds_sum") > 0
    assert value(gw, "mmfleet_itl_seconds_count") > 0
    assert value(gw, "mmfleet_e2e_seconds_count") >= 4
    assert value(gw, "mmfleet_inflight_requests") == 0
    assert value(gw, "mmfleet_nixl_bytes_total", direction="out") > 0  # the inline image, held for media-fetch
    # per modality: the image requests' items (the bad image's too: it was admitted), and every
    # chat request observed for each modality
    assert value(gw, "mmfleet_request_media_items_sum", modality="image") == 3
    assert value(gw, "mmfleet_request_media_items_sum", modality="video") == 0
    assert value(gw, "mmfleet_request_media_items_count", modality="audio") >= 5

    for w in workers:
        (stage,) = w.stages
        m = scrape(f"http://127.0.0.1:{w.metrics_port}/metrics")
        for hist in ("queue_wait", "transfer", "compute"):
            assert value(m, f"mmfleet_stage_{hist}_seconds_count", stage=stage) >= 2, (stage, hist)
        assert value(m, "mmfleet_stage_compute_seconds_sum", stage=stage) > 0, stage
        assert value(m, "mmfleet_stage_records_total", stage=stage, outcome="ok") >= 2, stage
        assert value(m, "mmfleet_consumer_lag_records", stage=stage) >= 0, stage  # present, per partition
        if stage == "prefill":  # the two images' tokens
            assert value(m, "mmfleet_media_tokens_total", modality="image") > 2
        if stage != "media-fetch":  # every later stage pulls its input (from a pool mapped on this host)
            assert value(m, "mmfleet_nixl_bytes_total", direction="in") > 0, stage
            assert value(m, "mmfleet_nixl_transfer_seconds_count") > 0, stage
        assert value(m, "mmfleet_nixl_pool_used_bytes") >= 0, stage  # present; in use drops back as leases end
        if stage == "media-fetch":
            assert value(m, "mmfleet_media_fetch_bytes_total", source="inline", modality="image") > 0
            assert value(m, "mmfleet_embedding_cache_misses_total", stage=stage, modality="image") >= 2
            assert value(m, "mmfleet_media_fetch_seconds_count", source="inline") >= 3
            assert value(m, "mmfleet_stage_records_total", stage=stage, outcome="failed") >= 1


def _json_lines(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):  # our records; native libraries may print plain lines too
            out.append(json.loads(line))
    return out


def test_json_logs_carry_the_request_id_through_the_stages(fleet, traffic, obs_logs):
    gateway = _json_lines(obs_logs / "gateway.log")
    assert gateway and all({"ts", "level", "logger", "pid", "process", "msg"} <= set(r) for r in gateway)
    access = {r["request_id"]: r["msg"] for r in gateway if r.get("request_id")}
    assert set(traffic) <= set(access), "every request's access line carries its id"
    bad = [rid for rid, msg in access.items() if msg.endswith(" 400") or " 400 " in msg]
    assert bad, access
    media = _json_lines(obs_logs / "media-fetch.log")
    failed = [r for r in media if r.get("request_id") == bad[-1]]
    assert failed and failed[0]["stage"] == "media-fetch" and failed[0]["process"].startswith("media-fetch")


# ------------------------------------------------------------------ the operator's view
# Both run on this module's fleet; the page test kills a worker, so it comes last.
def test_mmfleet_top_once_shows_every_stage_and_process(fleet, traffic, redis_url):
    _gateways, workers = asyncio.run(_endpoints(redis_url))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMFLEET_")}
    env.update({"REDIS_URL": redis_url, "MMFLEET_REDIS_PREFIX": PREFIX, "COLUMNS": "220"})
    out = subprocess.run([sys.executable, "-m", "services.cli", "top", "--once"], cwd=procs.REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {cells[0]: cells for line in out.stdout.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) > 3}
    for stage in STAGES:  # stage, workers, records, rec/s, lag, ...: the traffic's records are counted
        assert rows[stage][1] == "1" and int(rows[stage][2].replace(",", "")) >= 2, rows[stage]
        assert re.fullmatch(r"(p\d+:\d+ ?)+", rows[stage][4]), rows[stage]  # lag of each owned partition
    for w in workers:
        assert rows[w.worker_id][2] == "up", rows[w.worker_id]
    assert "by status 200:" in out.stdout and "TTFT" in out.stdout


def test_fleet_page_in_chromium_moves_under_load_and_shows_a_killed_worker_gone(fleet, traffic, redis_url):
    if browser.chromium_binary() is None:
        pytest.skip("no chromium: install Debian's `chromium` package (make test does, as root with apt)")
    asyncio.run(_drive_fleet_page(fleet, redis_url))


def _records(page_rows: dict, stage: str) -> float:
    return float(page_rows[stage]["records_total"].replace(",", ""))


async def _drive_fleet_page(base: str, redis_url: str) -> None:
    rows_js = ("Object.fromEntries([...document.querySelectorAll('#stages tr[data-stage]')].map(r => [r.dataset.stage,"
               " Object.fromEntries([...r.querySelectorAll('[data-field]')]"
               ".map(c => [c.dataset.field, c.textContent]))]))")
    state_js = ("Object.fromEntries([...document.querySelectorAll('#processes tr[data-process]')]"
                ".map(r => [r.dataset.process, r.dataset.state]))")
    _gateways, workers = await _endpoints(redis_url)
    async with browser.chromium() as page:
        await page.goto(base + "/fleet")
        await page.wait_for("document.body.dataset.updated", 30)
        before = await page.js(rows_js)
        assert set(before) == set(STAGES), before
        states = await page.js(state_js)
        assert {w.worker_id for w in workers} <= {pid for pid, s in states.items() if s == "up"}, states

        # a few requests while the page watches: counts, rates and the TTFT histogram move
        load = asyncio.gather(*(asyncio.to_thread(_one_request, base, seed) for seed in (11, 12, 13, 14)))
        moved = ("(() => { const r = %s; return r.decode && Number(r.decode.records_total.replace(/,/g, '')) >= %d"
                 " && Number(r.decode.records_per_s) > 0 && r; })()" % (rows_js, _records(before, "decode") + 2))
        try:
            after = await page.wait_for(moved, 180)
            shot = DOCS_SHOT if os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1" else None
            if shot is not None:  # under load: the docs' picture of the page, in 48 colours
                await page.screenshot(shot)
                Image.open(shot).convert("RGB").quantize(48, method=Image.Quantize.MEDIANCUT).save(shot, optimize=True)
        finally:
            await load
        assert _records(after, "decode") > _records(before, "decode")
        assert int(await page.js("document.getElementById('ttft').dataset.count")) > 0

        # a worker killed with SIGKILL cannot remove its record: the page shows it gone within
        # the record's TTL, plus one page refresh cycle (its wait and its fetch) and one collector interval
        victim = next(w for w in workers if w.stages == ("media-fetch",))
        refresh_s = await page.js("REFRESH_MS") / 1000
        ttl_s = inspect.signature(heartbeat).parameters["ttl_s"].default
        os.kill(victim.pid, signal.SIGKILL)
        gone = f"document.querySelector('#processes tr[data-process=\"{victim.worker_id}\"]')?.dataset.state === 'gone'"
        await page.wait_for(gone, ttl_s + 2 * refresh_s + 1.0)
        row = await page.js(f"document.querySelector('#processes tr[data-process=\"{victim.worker_id}\"]').innerText")
        assert "gone" in row, row


def _one_request(base: str, seed: int) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(
        model="mmfleet-demo", temperature=0, max_tokens=8, stream=True,
        messages=[{"role": "user", "content": image_parts([png_data_url(noise_image(seed))], "What is this?")}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
