"""The runner's metrics and log context against the real broker and Redis: each record's end
counts one outcome, every handler call feeds the stage histograms, the consumer lag gauge
covers the assigned partitions, and log records written while a record is handled carry its
request id and stage."""

from __future__ import annotations

from prometheus_client import REGISTRY

from shared import protocol
from shared.stage import Outcome, Produce, RequestFailed
from tests.transport.test_runner import _meta, _runner, _send, _start, _until, env  # noqa: F401 - fixture


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class ByName:
    """Outcome chosen by the request id's first word: ok / bad (400) / poison (always raises)."""

    def __init__(self, out_topic: str) -> None:
        self.out = out_topic
        self.seen: list[tuple[str | None, str | None]] = []

    async def handle(self, msg, ctx):
        from shared import logs

        self.seen.append((logs.request_id_var.get(), logs.stage_var.get()))
        kind = msg.meta.request_id.split("-")[0]
        if kind == "bad":
            raise RequestFailed.bad_request("no thanks")
        if kind == "poison":
            raise RuntimeError("poison")
        return Outcome([Produce(self.out, msg.meta.request_id, msg)])


async def test_outcomes_histograms_lag_and_log_context(env):  # noqa: F811 - the fixture
    stage = f"metrics-{env['tag']}"
    handler = ByName(env["out"])
    runner = _runner(env, handler, stage)
    task = await _start(runner)
    tag = env["tag"]
    for rid in (f"ok-{tag}-1", f"ok-{tag}-2", f"bad-{tag}", f"poison-{tag}"):
        await _send(env, protocol.PrefillRequest(meta=_meta(rid)))
    await _send(env, protocol.PrefillRequest(meta=_meta(f"late-{tag}", deadline_ms=-1)))
    await env["producer"].send_and_wait(env["in"], b"\x00garbage", key=b"g")
    await _until(lambda: runner.processed >= 6, timeout_s=30)

    def lag() -> list[float | None]:
        return [REGISTRY.get_sample_value("mmfleet_consumer_lag_records", {"stage": stage, "partition": p})
                for p in ("0", "1")]

    await _until(lambda: lag() == [0.0, 0.0], timeout_s=10)  # both partitions, all consumed
    runner.stop()
    await task

    counts = {o: sample("mmfleet_stage_records_total", stage=stage, outcome=o)
              for o in ("ok", "failed", "deadline", "dead_letter", "duplicate", "aborted")}
    assert counts == {"ok": 2, "failed": 1, "deadline": 1, "dead_letter": 2, "duplicate": 0, "aborted": 0}
    calls = 2 + 1 + env["settings"].max_attempts  # ok x2, bad once, poison retried; late and garbage never
    for hist in ("queue_wait", "transfer", "compute"):
        assert sample(f"mmfleet_stage_{hist}_seconds_count", stage=stage) == calls, hist
    assert sample("mmfleet_stage_compute_seconds_sum", stage=stage) >= 0
    assert sample("mmfleet_stage_queue_wait_seconds_sum", stage=stage) > 0  # produced before consumed
    # the runner drops its lag series when it stops (its partitions are no longer its own)
    assert REGISTRY.get_sample_value("mmfleet_consumer_lag_records", {"stage": stage, "partition": "0"}) is None
    assert {rid for rid, _ in handler.seen} == {f"ok-{tag}-1", f"ok-{tag}-2", f"bad-{tag}", f"poison-{tag}"}
    assert {s for _, s in handler.seen} == {stage}


class _ToLocal:
    """Hands every record to a stage of the same worker (its topic is in the runner's local routes)."""

    def __init__(self, local_topic: str) -> None:
        self.local_topic = local_topic

    async def handle(self, msg, ctx):
        return Outcome([Produce(self.local_topic, msg.meta.request_id, msg)])


async def test_a_stage_handed_its_message_in_memory_counts_its_records(env):  # noqa: F811 - the fixture
    """e-p-d's encode runs in the media-fetch worker and is never consumed from Kafka: its
    records are counted all the same (``mmfleet top`` and /fleet read them)."""
    from shared.stage import Context
    from shared.transport.runner import StageRunner

    tag = env["tag"]
    entry, local = f"entry-{tag}", f"local-{tag}"
    local_topic = f"t.local.{tag}"  # never produced to: the runner calls the local handler instead
    local_route = (ByName(env["out"]), Context(stage=local, worker_id="w", events=env["streams"]))
    runner = StageRunner(stage=entry, topic=env["in"], union=protocol.PrefillRequest, handler=_ToLocal(local_topic),
                         ctx=Context(stage=entry, worker_id="w", events=env["streams"]), producer=env["producer"],
                         settings=env["settings"], local_routes={local_topic: local_route})
    task = await _start(runner)
    for i in (1, 2):
        await _send(env, protocol.PrefillRequest(meta=_meta(f"ok-{tag}-{i}")))
    await _until(lambda: runner.processed >= 2, timeout_s=30)
    runner.stop()
    await task
    assert sample("mmfleet_stage_records_total", stage=entry, outcome="ok") == 2
    assert sample("mmfleet_stage_records_total", stage=local, outcome="ok") == 2
    assert sample("mmfleet_stage_compute_seconds_count", stage=local) == 2
