"""The start phase of ``mmfleet up`` (``Fleet._wait_serving``) on stand-in services (``sleep``
processes), their liveness records and the gateway's ``/ready`` answer scripted: a service that
exits before it ever served fails the start; one killed after ``/ready`` said 200, or after its
own record showed it serving, is restarted and the start completes once every group serves."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services import supervisor
from services.children import Child
from shared import protocol
from shared import settings as settings_mod
from shared.transport import liveness

GROUP = "media-fetch+encode+prefill+decode"


class Script:
    """What the start phase sees: the pids with a liveness record, and whether /ready says 200."""

    def __init__(self) -> None:
        self.serving: set[int] = set()
        self.ready = False

    async def live_workers(self, _redis, _keys):
        return [protocol.WorkerInfo(worker_id=str(pid), stages=tuple(GROUP.split("+")), pid=pid, host="h",
                                    started_unix_ms=0) for pid in self.serving]

    async def gateway_ready(self, _session) -> bool:
        return self.ready


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    script = Script()
    monkeypatch.setattr(liveness, "live_workers", script.live_workers)
    s = settings_mod.from_env({}, stage_replicas="prefill=2", up_ready_timeout_s=60, redis_url="redis://127.0.0.1:1/0")
    f = supervisor.Fleet(s, mode="epd", log_dir=tmp_path)
    monkeypatch.setattr(f, "_gateway_ready", script.gateway_ready)
    f.services = [Child(name, ["sleep", "300"], restart=True) for name in (GROUP, f"{GROUP}-2", "gateway")]
    for child in f.services:
        child.start()
    try:
        yield f, script
    finally:
        f.stop()  # every stand-in, restarted ones included


async def _until(check, timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def _kill(child: Child) -> int:
    pid = child.proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_worker_lost_after_ready_said_200_is_restarted_not_a_failed_start(fleet):
    f, script = fleet
    first, second, gateway = f.services

    async def go():
        waiting = asyncio.create_task(f._wait_serving())
        script.serving = {first.proc.pid}
        script.ready = True  # one worker of the group serves: /ready says 200 while the second still starts
        await asyncio.sleep(0.5)
        killed = _kill(second)  # lost after /ready said 200
        await _until(lambda: second.proc.pid != killed and second.proc.poll() is None)
        assert not waiting.done() and second.restarts == 1
        script.serving = {first.proc.pid, second.proc.pid}
        await asyncio.wait_for(waiting, 20)  # the start completes: the fleet was never stopped

    asyncio.run(go())


def test_a_worker_lost_after_it_served_is_restarted_even_before_ready(fleet):
    f, script = fleet
    first, second, gateway = f.services

    async def go():
        waiting = asyncio.create_task(f._wait_serving())
        script.serving = {first.proc.pid}
        await asyncio.sleep(0.5)
        killed = _kill(first)
        script.serving = set()
        await _until(lambda: first.proc.pid != killed and first.proc.poll() is None)
        script.serving, script.ready = {first.proc.pid, second.proc.pid}, True
        await asyncio.wait_for(waiting, 20)

    asyncio.run(go())


def test_a_service_that_exits_before_it_ever_served_fails_the_start(fleet):
    f, script = fleet
    first, second, gateway = f.services

    async def go():
        waiting = asyncio.create_task(f._wait_serving())
        await asyncio.sleep(0.5)
        _kill(gateway)
        with pytest.raises(RuntimeError, match="gateway exited with -9 during start"):
            await asyncio.wait_for(waiting, 20)

    asyncio.run(go())
