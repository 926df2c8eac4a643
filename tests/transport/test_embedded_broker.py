"""The embedded broker as ``mmfleet up``, the harness and the tests start it
(``services.embedded_broker``): one tokio worker thread, and it serves Kafka."""

from __future__ import annotations

import asyncio
import os

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from loadtest.procs import spawn, stop_group, wait_port
from services import embedded_broker
from tests import procs
from tests.waits import until


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def _round_trip(bootstrap: str) -> bytes:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait("embedded-broker-check", b"one record")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer("embedded-broker-check", bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        return (await asyncio.wait_for(consumer.getone(), 30)).value
    finally:
        await consumer.stop()


def test_the_embedded_broker_runs_one_worker_thread_and_serves(tmp_path):
    pids: list[int] = []
    with procs.broker(tmp_path, pids) as bootstrap:
        # counted before any client came: the main thread and the runtime's workers (tokio's
        # default: one a core); its blocking pool adds threads on demand later
        assert _threads(pids[0]) <= 1 + embedded_broker.THREADS
        assert asyncio.run(_round_trip(bootstrap)) == b"one record"


def test_without_the_setting_the_broker_starts_a_worker_a_core(tmp_path):
    """The control for the test above: the thread count does tell the setting apart."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: tokio's default is one worker as well, nothing to tell apart")
    port = procs.free_port()
    argv, env = embedded_broker.command(f"tcp://127.0.0.1:{port}")
    env.pop("TOKIO_WORKER_THREADS")
    proc = spawn(argv, log_path=tmp_path / "tansu.log", env=env)
    try:
        wait_port(port, proc)
        asyncio.run(until(lambda: _threads(proc.pid) > 1 + embedded_broker.THREADS, 10,
                          lambda: f"({_threads(proc.pid)} threads with {cores} cores)"))
    finally:
        stop_group(proc)
