"""Two ``mmfleet up`` on one host (mode epd: one worker each, on one shared redis-server). Started
at the same moment with the same settings, one runs and the other refuses naming the broker's
port and how to choose another; then, beside the running fleet, a second one is refused for
each thing the first owns (its broker, its gateway port, its Redis prefix) and runs with its
own. The first fleet is untouched throughout: its broker token is never bumped, its liveness
records stay its own, and it answers before and after."""

from __future__ import annotations

import subprocess
import time

import openai
import redis

from shared import protocol
from shared.keys import RedisKeys
from tests import procs

MODEL = "mmfleet-demo"
REFUSAL_TIMEOUT_S = 120


def _env(redis_url: str, model_dir, *, bootstrap: str, prefix: str, port: int) -> dict[str, str]:
    return {"KAFKA_BOOTSTRAP": bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
            "MMFLEET_REDIS_PREFIX": prefix, "MMFLEET_GATEWAY_PORT": str(port),
            "MMFLEET_POOL_BYTES": str(64 << 20)}


def _answers(base: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return reply.choices[0].message.content


def _refused(env: dict[str, str], log_dir, name: str) -> str:
    """Run ``mmfleet up`` with ``env``; it must exit 2 without ever being ready; its output."""
    proc, _, ready_file = procs.start_up(env, log_dir, mode="epd", log_name=f"{name}.log")
    try:
        proc.wait(REFUSAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        procs.stop_up(proc)
    out = (log_dir / f"{name}.log").read_text()
    assert proc.returncode == 2 and not ready_file.exists(), f"{name}: exit {proc.returncode}\n{out[-3000:]}"
    return out


def _workers(r: redis.Redis, keys: RedisKeys) -> list[protocol.WorkerInfo]:
    listed = r.zrange(keys.workers_index(), 0, -1)
    return [protocol.decoder_for(protocol.WorkerInfo).decode(raw) for raw in r.mget(listed) if raw] if listed else []


def _first_ready(racers: list[tuple[subprocess.Popen, str, object]], timeout_s: float = 240) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, (proc, _, ready_file) in enumerate(racers):
            if ready_file.exists():
                return i
        if all(proc.poll() is not None for proc, _, _ in racers):
            break
        time.sleep(0.2)
    raise AssertionError(f"neither fleet came up: exits {[p.poll() for p, _, _ in racers]}")


def test_a_second_fleet_on_one_host_refuses_what_the_first_owns_or_runs_on_its_own(redis_url, model_dir, logs_dir):
    log_dir = logs_dir / "two-fleets"
    log_dir.mkdir()
    bootstrap = f"127.0.0.1:{procs.free_port()}"  # nothing there yet: the winner starts its embedded broker
    port = procs.free_port()
    env_a = _env(redis_url, model_dir, bootstrap=bootstrap, prefix="two-a", port=port)
    racers = [procs.start_up(env_a, log_dir, mode="epd", log_name=f"racer{i}.log") for i in range(2)]
    try:
        winner = _first_ready(racers)
        loser, _, loser_ready = racers[1 - winner]
        assert loser.wait(REFUSAL_TIMEOUT_S) == 2 and not loser_ready.exists()
        out = (log_dir / f"racer{1 - winner}.log").read_text()
        assert f"cannot start: another `mmfleet up` (pid {racers[winner][0].pid}" in out, out[-3000:]
        assert f"runs on the broker at {bootstrap}" in out and "--kafka-bootstrap 127.0.0.1:" in out, out[-3000:]
        base_a = racers[winner][1]
        r = redis.Redis.from_url(redis_url)
        keys_a = RedisKeys("two-a")
        epoch = r.get(keys_a.broker_epoch())
        assert epoch is not None  # the winner's own embedded broker: bumped once, before its workers
        assert _answers(base_a)

        # beside it: its broker, its gateway port, its Redis prefix are each refused
        other_port = procs.free_port()
        out = _refused({**env_a, "MMFLEET_GATEWAY_PORT": str(other_port)}, log_dir, "same-broker")
        assert f"runs on the broker at {bootstrap}" in out, out[-3000:]
        own_broker = f"127.0.0.1:{procs.free_port()}"
        out = _refused({**env_a, "KAFKA_BOOTSTRAP": own_broker}, log_dir, "same-port")
        assert f"the gateway port {port} on 127.0.0.1 is taken by another `mmfleet up`" in out, out[-3000:]
        assert "--port " in out
        out = _refused({**env_a, "KAFKA_BOOTSTRAP": own_broker, "MMFLEET_GATEWAY_PORT": str(other_port)},
                       log_dir, "same-prefix")
        assert "the Redis prefix 'two-a'" in out and "MMFLEET_REDIS_PREFIX=<name>" in out, out[-3000:]

        # with its own broker, port and prefix it runs beside the first, each on its own
        env_b = _env(redis_url, model_dir, bootstrap=own_broker, prefix="two-b", port=other_port)
        with procs.fleet(env_b, log_dir, mode="epd") as (base_b, _):
            assert _answers(base_b) and _answers(base_a)
            assert r.get(keys_a.broker_epoch()) == epoch, "the second fleet bumped the first one's broker token"
            workers_a, workers_b = _workers(r, keys_a), _workers(r, RedisKeys("two-b"))
            assert len(workers_a) == len(workers_b) == 1, (workers_a, workers_b)  # epd: one worker each
            assert workers_a[0].pid != workers_b[0].pid
        assert racers[winner][0].poll() is None, "the first fleet stopped"
        assert r.get(keys_a.broker_epoch()) == epoch
        assert _answers(base_a)
        r.close()
    finally:
        for proc, _, _ in racers:
            procs.stop_up(proc)
