"""``mmfleet up --autoscale``: the supervisor's loop that adds and removes workers per stage
group between ``autoscale_min_workers`` and ``autoscale_max_workers``.

Every ``autoscale_interval_ms`` it reads each group's consumer-group lag (committed vs end
offset: work in flight counts, as the runner commits only durable outputs) and the gateway's
TTFT p99 over the last ``_WINDOW_S`` (``/metrics``); :class:`shared.autoscale.GroupScaler`
decides. A worker is added as a supervised child or the group's newest is stopped (SIGTERM: it
drains, and what it had not committed is redelivered). An unreadable signal holds every group.
Design: docs/deploy/autoscaling.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time

import aiohttp
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from services.modes import MODES, entry_stages
from services.stages import BY_NAME
from shared import settings as settings_mod
from shared.autoscale import Bounds, GroupScaler, p99_from_buckets
from shared.keys import consumer_group
from shared.transport.bus import kafka_client_kwargs

log = logging.getLogger("mmfleet.autoscale")

_WINDOW_S = 10.0  # TTFT p99 over this much recent history


class LagReader:
    """Σ (end offset − committed offset) over a group's partitions, from the broker."""

    def __init__(self, settings: settings_mod.Settings) -> None:
        kw = kafka_client_kwargs(settings)
        self._admin = AIOKafkaAdminClient(**kw, request_timeout_ms=5_000)
        self._ends = AIOKafkaConsumer(**kw, group_id=None, enable_auto_commit=False)

    async def start(self) -> None:
        await self._admin.start()
        await self._ends.start()

    async def stop(self) -> None:
        await self._ends.stop()
        await self._admin.close()

    async def lag(self, group: str, topic: str) -> int:
        await self._ends.topics()  # refreshes metadata: the partitions of ``topic``
        parts = [TopicPartition(topic, p) for p in sorted(self._ends.partitions_for_topic(topic) or ())]
        if not parts:
            return 0
        ends = await self._ends.end_offsets(parts)
        committed = await self._admin.list_consumer_group_offsets(group, partitions=parts)
        lag = 0
        for tp in parts:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else 0
            lag += max(ends[tp] - done, 0)
        return lag


class TtftWindow:
    """The gateway's TTFT histogram, differenced over the last ``window_s``."""

    def __init__(self, url: str, window_s: float = _WINDOW_S) -> None:
        self._url = url
        self._window_s = window_s
        self._history: collections.deque[tuple[float, dict[float, float]]] = collections.deque()

    async def p99(self, session: aiohttp.ClientSession, now_s: float) -> float | None:
        async with session.get(self._url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            text = await resp.text()
        buckets: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "mmfleet_ttft_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + sample.value
        self._history.append((now_s, buckets))
        while len(self._history) > 1 and now_s - self._history[1][0] >= self._window_s:
            self._history.popleft()
        _, old = self._history[0]
        return p99_from_buckets([(le, c - old.get(le, 0.0)) for le, c in sorted(buckets.items())])


class Autoscaler:
    """Drives ``fleet`` (a :class:`services.supervisor.Fleet` that has started)."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        s = fleet.settings
        bounds = Bounds.from_settings(s)
        self.interval_s = s.autoscale_interval_ms / 1000
        self.scalers = {group: GroupScaler(group, bounds) for group in MODES[fleet.mode]}
        self._ttft = TtftWindow(f"http://{s.gateway_host}:{s.gateway_port}/metrics")
        self._spawned = 0

    async def run(self) -> None:
        lags = LagReader(self.fleet.settings)
        await lags.start()
        try:
            async with aiohttp.ClientSession() as session:
                while True:
                    await asyncio.sleep(self.interval_s)
                    try:
                        await self.tick(lags, session)
                    except (OSError, aiohttp.ClientError, TimeoutError, asyncio.TimeoutError) as exc:
                        log.warning("autoscale: signals unreadable this tick (%r); no change", exc)
                    except Exception as exc:  # a Kafka error: the broker restarting
                        log.warning("autoscale: %r; no change this tick", exc)
        finally:
            await lags.stop()

    async def tick(self, lags: LagReader, session: aiohttp.ClientSession) -> None:
        now = time.monotonic()
        p99 = await self._ttft.p99(session, now)
        for group, scaler in self.scalers.items():
            lag = 0
            for stage in entry_stages(group):
                lag += await lags.lag(consumer_group(stage), BY_NAME[stage].topic)
            current = len(self.workers(group))
            target, why = scaler.decide(current, lag, p99, now)
            if target != current:
                log.info("autoscale: %s %d -> %d workers (%s)", "+".join(group), current, target, why)
            for _ in range(target - current):
                self.add(group)
            for _ in range(current - target):
                await self.remove(group)

    def workers(self, group: tuple[str, ...]) -> list:
        flag = ",".join(group)
        return [c for c in self.fleet.services if "--stages" in c.argv and c.argv[c.argv.index("--stages") + 1] == flag]

    def add(self, group: tuple[str, ...]) -> None:
        from services.children import worker_settings

        f = self.fleet
        self._spawned += 1
        env = settings_mod.child_env(worker_settings(f.settings, len(f.services) + self._spawned))
        child = f._child(f"{'+'.join(group)}-as{self._spawned}",
                         [sys.executable, "-m", "services.cli", "worker", "--stages", ",".join(group)], env)
        f.services.append(child)
        child.start()

    async def remove(self, group: tuple[str, ...]) -> None:
        """Stop the group's newest worker (never below one: the policy's floor is >= 1)."""
        workers = self.workers(group)
        if len(workers) <= 1:
            return
        child = workers[-1]
        self.fleet.services.remove(child)  # first: the supervisor must not restart it
        await asyncio.to_thread(child.stop, self.fleet.stop_timeout_s)
