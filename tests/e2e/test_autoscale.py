"""``mmfleet up --autoscale`` (services/autoscale.py) through a real fleet: a burst of streamed
requests makes the stage group's consumer lag pass ``autoscale_lag_per_worker``, the supervisor
starts a second worker; once the burst is answered and the lag stays 0 for
``autoscale_scale_down_after_s``, it stops it again. Every answer equals the temperature-0
reference. Mode epd (one worker process per replica) keeps the fleet small."""

from __future__ import annotations

import asyncio
import threading
import time

import openai

from tests import procs
from tests.chaos.load import PROMPTS, one, reference_texts

BURST = 128  # long enough to span several autoscaler ticks on a fast machine (32 took 0.8 s, no tick saw it)
TEXT_ONLY = [i for i, (imgs, _) in enumerate(PROMPTS) if not imgs]


async def _burst(base: str) -> list:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(one(client, TEXT_ONLY[i % len(TEXT_ONLY)]) for i in range(BURST)))
    finally:
        await client.close()


def test_autoscale_adds_a_worker_under_a_burst_and_removes_it_after(kafka_bootstrap, redis_url, model_dir, logs_dir):
    references = reference_texts(model_dir)
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_REDIS_PREFIX": "autoscale", "MMFLEET_AUTOSCALE_MAX_WORKERS": "2",
           "MMFLEET_AUTOSCALE_LAG_PER_WORKER": "4", "MMFLEET_AUTOSCALE_INTERVAL_MS": "300",
           "MMFLEET_AUTOSCALE_SCALE_DOWN_AFTER_S": "4"}
    log_dir = logs_dir / "autoscale"
    log_dir.mkdir()
    with procs.fleet(env, log_dir, mode="epd", up_args=("--autoscale",)) as (base, supervisor):
        counts: list[tuple[float, int]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                counts.append((time.monotonic(), procs.worker_count(supervisor.pid)))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            t0 = time.monotonic()
            results = asyncio.run(_burst(base))
            answered = time.monotonic()
            deadline = answered + 90
            while procs.worker_count(supervisor.pid) > 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            settled = time.monotonic()
            final = procs.worker_count(supervisor.pid)  # the watcher's last sample may predate the exit
        finally:
            stop.set()
            watcher.join()
        log = (log_dir / "supervisor.log").read_text()
    peak = max(n for _, n in counts)
    print(f"\nautoscale: burst of {BURST} answered in {answered - t0:.1f} s, peak {peak} workers, back to "
          f"{final} {settled - answered:.1f} s after; decisions: "
          f"{[line.split('autoscale: ', 1)[1] for line in log.splitlines() if 'autoscale: ' in line]}")
    assert [r[1] for r in results] == ["completed"] * BURST, results
    assert [text for i, _, text in results] == [references[i] for i, _, _ in results]
    assert counts[0][1] == 1 and peak == 2, counts
    assert "-> 2 workers (lag" in log and "2 -> 1 workers" in log
    assert final == 1, "scaled back down to the floor once idle"
