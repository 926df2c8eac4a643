"""A fleet across hosts, on one machine: network namespaces on a private bridge stand in for
hosts ("infra": broker, Redis, gateway, media-fetch; "enc1", "enc2": an encode worker each;
"pd": prefill and decode). ``UCX_TLS=tcp`` (hosts share no memory), so every NIXL READ between
hosts crosses the bridge. Proves: every advertised address (Kafka listener, liveness records,
metrics URLs, NIXL peers) is the host's own, never 127.0.0.1; answers equal the temperature-0
references; taking host enc1 down under load loses nothing (reference text or explicit error);
the metrics show NIXL bytes that crossed hosts. Skips, saying why, where namespaces cannot be
created. 8 processes, 12 requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from collections import Counter

import msgspec
import pytest
import redis

from services import embedded_broker
from shared import protocol
from shared.keys import RedisKeys
from tests.chaos.load import PROMPTS, TIMEOUT_MS, load_with_fault, reference_texts
from tests.multihost import netns

REQUESTS = 8
CONCURRENCY = 4
PREFIX = "multihost"
CROSS = "mmfleet_nixl_cross_host_bytes_total"

_WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces: {_WHY_NOT}")


def _env(host: netns.Host, infra: netns.Host, model_dir) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MMFLEET_") and k not in ("KAFKA_BOOTSTRAP", "REDIS_URL")}
    env.update({
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp",
        "KAFKA_BOOTSTRAP": f"{infra.addr}:9092", "REDIS_URL": f"redis://{infra.addr}:6379/0",
        "MMFLEET_REDIS_PREFIX": PREFIX, "MMFLEET_MODEL_PATH": str(model_dir),
        # each process binds (and so advertises) its own host's address: nothing says 127.0.0.1
        "MMFLEET_METRICS_HOST": host.addr, "MMFLEET_GATEWAY_HOST": infra.addr, "MMFLEET_GATEWAY_PORT": "8000",
        "MMFLEET_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS), "MMFLEET_POOL_BYTES": str(64 << 20),
        "MMFLEET_STAGE_LEASE_MS": "6000",
        # the namespaces share one kernel, host name and /proc, so a consumer could map its owner's
        # pool (host-shm) as on one host; these "hosts" are about the network path: NIXL over TCP
        "MMFLEET_TRANSFER_HOST_SHM": "false"})
    return env


def _records(redis_url: str) -> tuple[list[protocol.WorkerInfo], list[protocol.GatewayInfo]]:
    r = redis.Redis.from_url(redis_url)
    keys = RedisKeys(PREFIX)
    try:
        workers = [msgspec.msgpack.decode(r.get(k), type=protocol.WorkerInfo)
                   for k in r.scan_iter(keys.workers_pattern())]
        gateways = [msgspec.msgpack.decode(r.get(k), type=protocol.GatewayInfo)
                    for k in r.scan_iter(keys.gateways_pattern())]
    finally:
        r.close()
    return workers, gateways


def _wait_fleet(redis_url: str, gateway: str, wanted: Counter, children, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p.args for p in children if p.poll() is not None]
        assert not dead, f"exited during start: {dead}"
        try:
            workers, gateways = _records(redis_url)
            with urllib.request.urlopen(gateway + "/ready", timeout=2) as resp:
                ready = resp.status == 200
        except (OSError, redis.RedisError):
            workers, gateways, ready = [], [], False
        if ready and gateways and not wanted - Counter(w.stages for w in workers):
            return workers, gateways
        time.sleep(0.5)
    raise AssertionError(f"fleet not up across hosts within {timeout_s} s")


def _cross_host_bytes(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(CROSS + "{"):
            peer = line.split('peer_host="', 1)[1].split('"', 1)[0]
            out[peer] = float(line.rsplit(" ", 1)[1])
    return out


def test_fleet_across_hosts_survives_losing_one(model_dir, logs_dir):
    references = reference_texts(model_dir)
    log_dir = logs_dir / "multihost"
    log_dir.mkdir()
    cli = [sys.executable, "-m", "services.cli"]
    with netns.hosts(["infra", "enc1", "enc2", "pd"]) as h:
        infra = h["infra"]
        argv, broker_env = embedded_broker.command(f"tcp://{infra.addr}:9092", _env(infra, infra, model_dir))
        broker = infra.spawn(argv, env=broker_env, log_path=log_dir / "tansu.log")
        infra.spawn(["redis-server", "--bind", infra.addr, "--port", "6379", "--save", "", "--appendonly", "no",
                     "--protected-mode", "no"],  # else it refuses every client not on loopback
                    env=_env(infra, infra, model_dir), log_path=log_dir / "redis.log")
        topics = infra.spawn(cli + ["topics"], env=_env(infra, infra, model_dir), log_path=log_dir / "topics.log")
        deadline = time.monotonic() + 60
        while topics.poll() is None and time.monotonic() < deadline:  # retries until the broker answers
            time.sleep(0.2)
        assert topics.returncode == 0, procs_log(log_dir / "topics.log")
        layout = [(infra, "media-fetch"), (h["enc1"], "encode"), (h["enc2"], "encode"), (h["pd"], "prefill"),
                  (h["pd"], "decode")]
        children = [broker]
        for host, stage in layout:
            children.append(host.spawn(cli + ["worker", "--stages", stage], env=_env(host, infra, model_dir),
                                       log_path=log_dir / f"{stage}-{host.name}.log"))
        children.append(infra.spawn(cli + ["gateway"], env=_env(infra, infra, model_dir),
                                    log_path=log_dir / "gateway.log"))
        gateway = f"http://{infra.addr}:8000"
        redis_url = f"redis://{infra.addr}:6379/0"
        wanted = Counter({("media-fetch",): 1, ("encode",): 2, ("prefill",): 1, ("decode",): 1})
        workers, gateways = netns.run_in(infra, _wait_fleet, redis_url, gateway, wanted, children)

        # every advertised address is the host's own
        where = {(host.addr, stage) for host, stage in layout}
        assert {(w.host, w.stages[0]) for w in workers} == where
        for w in workers:
            assert w.metrics_url == f"http://{w.host}:{w.metrics_port}/metrics"
        assert [g.url for g in gateways] == [gateway]

        async def take_down_enc1(_tasks):
            await asyncio.sleep(2)  # requests in flight at every stage
            await asyncio.to_thread(h["enc1"].take_down)
            return h["enc1"].netns

        t0 = time.monotonic()
        results, downed, after = netns.run_in(
            infra, lambda: asyncio.run(load_with_fault(gateway, REQUESTS, CONCURRENCY, take_down_enc1)))
        elapsed = time.monotonic() - t0
        survivors = [w for w in workers if w.host != h["enc1"].addr]
        crossed = {f"{w.stages[0]}@{w.host}": netns.run_in(infra, _cross_host_bytes, w.metrics_url) for w in survivors}
    gone = netns._ip("netns", "list").stdout
    outcomes = Counter(kind for _, kind, _ in results)
    wrong = [(i, text) for i, kind, text in results if kind == "completed" and text != references[i % len(PROMPTS)]]
    print(f"\nmultihost: {REQUESTS} requests in {elapsed:.1f} s, took down {downed}, outcomes {dict(outcomes)}, "
          f"cross-host NIXL bytes {json.dumps(crossed)}")
    assert downed not in gone and netns.PREFIX + str(os.getpid()) not in gone  # every namespace removed
    assert len(results) == REQUESTS  # none hung
    assert not wrong, f"{len(wrong)} completions differ from the reference: {wrong[:3]}"
    assert outcomes["completed"] >= REQUESTS * 0.9, outcomes
    assert [t for _, _, t in after] == references  # and it serves on with one encode host
    # pixels crossed from the infra host to the surviving encoder, embeddings from an encoder to prefill
    assert crossed[f"encode@{h['enc2'].addr}"].get(infra.addr, 0) > 0, crossed
    assert sum(v for peer, v in crossed[f"prefill@{h['pd'].addr}"].items()
               if peer in (h["enc1"].addr, h["enc2"].addr)) > 0, crossed


def procs_log(path) -> str:
    from tests.procs import log_tail

    return log_tail(path)
