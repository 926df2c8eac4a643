"""``mmfleet up``: the whole fleet on one machine, as supervised child processes.

Order: the fleet's claims (its broker, gateway port and Redis prefix: ``services.fleet_claims``)
→ Kafka (the broker at ``kafka_bootstrap``, else the embedded ``tansu`` started there) → Redis
(``redis_url``, else a ``redis-server``) → the model → topics → one worker per stage group (more
per ``stage_replicas``) → gateway, forked by the zygote or started as ``python -m``, each dying
with the supervisor. The start ends when every group serves and the gateway's ``/ready`` says
200; a service that exits before it ever served fails it, any other restarts with backoff (1 s
doubling to 30 s), a broker or Redis started here with fresh broker tokens. SIGINT / SIGTERM stop
services, then Redis and the broker. Design: docs/design/startup.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from services.children import Child, _answers, _host_port, _wait_port, broker_child, redis_child, worker_settings
from services.fleet_claims import FleetClaims, Taken
from services.modes import MODES, check_engine, group_replicas, parse_replicas
from services.stages import fleet_topics
from shared import settings as settings_mod
from shared.keys import RedisKeys
from shared.models.registry import resolve_model_path
from shared.process import gcpolicy
from shared.process.aio import wait_event
from shared.process.zygote import Zygote, become_subreaper, reap_strays
from shared.settings import Settings
from shared.transport.bus import ensure_topics
from shared.transport.consume import BROKER_RESTART_GRACE_MS
from shared.transport.redis_conn import make_redis

log = logging.getLogger("mmfleet.up")


class CannotStart(Exception):
    """A fault found before anything was started (e.g. the model is not there): `up` says why
    and exits non-zero, without a traceback."""


# what every process the zygote forks runs: imported once, in the zygote
ZYGOTE_PRELOAD = ("services.cli", "services.gateway.main", "services.worker")


def zygote_preload(engine: str) -> tuple[str, ...]:
    """What the zygote imports: the fleet's entry modules, and for the transformers engine its
    model's modeling and processor code (vLLM's engine core is a process of its own)."""
    family = ("shared.engines.transformers_engine:preload_family",) if engine == "transformers" else ()
    return ZYGOTE_PRELOAD + family


class Fleet:
    def __init__(self, settings: Settings, *, mode: str = "e-p-d", log_dir: Path | None = None,
                 stop_timeout_s: float = 15.0) -> None:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; supported: {', '.join(MODES)}")
        from shared.engines.registry import engine_capabilities

        caps = engine_capabilities(settings.engine)
        for stages in MODES[mode]:  # refuse an unsupported (mode, engine) before starting anything
            check_engine(stages, settings.engine, caps)
        self.settings = settings
        self.mode = mode
        self.replicas = parse_replicas(settings.stage_replicas)
        self.log_dir = log_dir
        if log_dir is not None:  # `mmfleet up --log-dir DIR` on a folder not made yet
            log_dir.mkdir(parents=True, exist_ok=True)
        self.stop_timeout_s = stop_timeout_s
        self.infra: list[Child] = []
        self.services: list[Child] = []
        self.zygote: Zygote | None = None
        self._subreaper = False
        self._stopping = asyncio.Event()
        self.claims = FleetClaims(settings)
        self._claim_task: asyncio.Task | None = None
        self._restarts: set[asyncio.Task] = set()

    async def start(self) -> None:
        try:  # before anything: a fleet already on this broker or gateway port stops this one here
            self.claims.take_host()
        except Taken as exc:
            raise CannotStart(str(exc)) from None
        # the model next: a missing one stops `up` before anything starts. Children get the
        # resolved folder (served_model_name already holds the id), so every worker serves the
        # same snapshot even if the cache's refs/<revision> moves while the fleet runs.
        try:
            model_dir = await asyncio.to_thread(resolve_model_path, self.settings)
            if self.settings.engine == "vllm":  # vLLM settings the device or model cannot take
                from shared.engines.vllm_config import check

                await asyncio.to_thread(check, self.settings, model_dir)
            if self.settings.engine == "sglang":  # SGLang not installed, no GPU, knobs that clash
                from shared.engines.sglang_config import check as check_sglang

                await asyncio.to_thread(check_sglang, self.settings, model_dir)
        except ValueError as exc:
            raise CannotStart(str(exc)) from None
        self.settings = s = self.settings.with_overrides(model=str(model_dir))
        env = settings_mod.child_env(s)
        rhost, rport = _host_port(s.redis_url, 6379)
        if _answers(rhost, rport):  # a Redis already there: its prefix is ours before anything starts
            await self._claim_redis()
        if s.zygote:  # its imports overlap the broker's and Redis's start
            become_subreaper()
            self._subreaper = True
            self.zygote = Zygote.start(env, self.log_dir / "zygote.log" if self.log_dir else None,
                                       model_dir=str(model_dir), preload=zygote_preload(s.engine))
        khost, kport = _host_port(s.kafka_bootstrap, 9092)
        if not _answers(khost, kport):
            await self._start_infra(broker_child(khost, kport), khost, kport)
        if self._claim_task is None:  # the Redis started here; the prefix is ours before any token is bumped
            await self._start_infra(redis_child(rhost, rport), rhost, rport)
            await self._claim_redis()
        await ensure_topics(s, fleet_topics(s))
        if any(c.name.startswith("kafka") for c in self.infra):
            await self._bump(RedisKeys.broker_epoch, RedisKeys.broker_ready)
        if self.zygote is not None and not await asyncio.to_thread(self.zygote.wait_ready):
            self.zygote = None  # it said why; every process starts as its own `python -m`
        cli = [sys.executable, "-m", "services.cli"]
        for stages in MODES[self.mode]:
            name = "+".join(stages)
            for r in range(group_replicas(stages, self.replicas)):  # replica 1 keeps the plain name
                wenv = settings_mod.child_env(worker_settings(s, len(self.services)))
                self.services.append(self._child(name if r == 0 else f"{name}-{r + 1}",
                                                 cli + ["worker", "--stages", ",".join(stages)], wenv))
        self.services.append(self._child("gateway", cli + ["gateway"], env))
        for child in self.services:
            child.start()
        await self._wait_serving()

    async def _claim_redis(self) -> None:
        try:
            await self.claims.take_redis()
        except Taken as exc:
            raise CannotStart(str(exc)) from None
        self._claim_task = asyncio.create_task(self.claims.hold(), name="fleet-claim")

    async def _wait_serving(self) -> None:
        """The start phase: until every stage group has its live workers (their liveness records,
        up_ready_timeout_s) and then the gateway's ``/ready`` says 200 (as long again). A service
        that exits before it ever served (no liveness record, no 200) fails the start; one lost
        after it served, or once ``/ready`` said 200, is restarted: the fleet already answers."""
        from collections import Counter

        from shared.transport.liveness import live_workers

        wanted = Counter({tuple(stages): group_replicas(tuple(stages), self.replicas) for stages in MODES[self.mode]})
        keys = RedisKeys(self.settings.redis_prefix)
        redis = make_redis(self.settings)
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.up_ready_timeout_s
        workers_by, ready_by = loop.time() + timeout_s, None
        served: set[str] = set()  # services seen serving (a liveness record, the gateway's 200)
        ready_seen = False
        try:
            async with aiohttp.ClientSession() as session:
                while True:
                    self._check_children()
                    workers = await live_workers(redis, keys)
                    pids = {w.pid for w in workers}
                    served |= {c.name for c in self.services if c.proc is not None and c.proc.pid in pids}
                    ready = await self._gateway_ready(session)
                    if ready:
                        ready_seen = True
                        served.add("gateway")
                    for child in self.services:
                        if child.proc is None or child.proc.poll() is None or child.restarting:
                            continue
                        if not ready_seen and child.name not in served:
                            where = f"; see {child.log_path}" if child.log_path else ""
                            raise RuntimeError(f"{child.name} exited with {child.proc.returncode} during start{where}")
                        self._restart(child)
                    missing = wanted - Counter(w.stages for w in workers)
                    if ready and not missing:
                        for w in workers:  # the URL each advertises (its host's own address)
                            log.info("worker %s: metrics on %s", w.worker_id,
                                     w.metrics_url or f"http://{w.host}:{w.metrics_port}/metrics")
                        log.info("fleet ready: %s/v1", self.claims.info.gateway_url)
                        return
                    if not missing and ready_by is None:
                        ready_by = loop.time() + timeout_s  # every group serves: /ready gets as long again
                    if ready_by is None and loop.time() > workers_by:
                        raise RuntimeError(f"workers for {sorted(missing.elements())} not serving after {timeout_s} s")
                    if ready_by is not None and loop.time() > ready_by:
                        raise RuntimeError(f"gateway not ready within {timeout_s} s of every worker group serving")
                    await asyncio.sleep(0.3)
        finally:
            await redis.aclose()

    async def _gateway_ready(self, session: aiohttp.ClientSession) -> bool:
        """``/ready`` said 200, and it was this fleet's gateway that said it (its pid)."""
        gateway = next(c for c in self.services if c.name == "gateway")
        url = f"http://{self.settings.gateway_host}:{self.settings.gateway_port}/ready"
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return gateway.proc is not None and body.get("pid") == gateway.proc.pid

    def _child(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        return Child(name, argv, restart=True, env=env, log_path=log_path, zygote=self.zygote)

    async def _start_infra(self, child: Child, host: str, port: int) -> None:
        if self.log_dir:
            child.log_path = self.log_dir / f"{child.name.split('(')[0]}.log"
        child.host, child.port = host, port
        child.start()
        self.infra.append(child)
        await _wait_port(host, port, 20, child)

    def _check_children(self) -> None:
        for child in self.infra:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}")

    async def supervise(self) -> None:
        """Restart what exits until ``stop()``: infra at once, services with backoff."""
        while not self._stopping.is_set():
            for child in self.infra:
                if child.proc is not None and child.proc.poll() is not None:
                    await self._restart_infra(child)
            for child in self.services:
                if child.proc is not None and child.proc.poll() is not None and not child.restarting:
                    self._restart(child)
            if self._subreaper:  # a dead worker's own children come to us
                reap_strays({c.proc.pid for c in [*self.infra, *self.services] if c.proc is not None}
                            | ({self.zygote.proc.pid} if self.zygote else set()))
            await wait_event(self._stopping, 0.5)
        await self._cancel_restarts()

    async def _cancel_restarts(self) -> None:
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)

    def _restart(self, child: Child) -> None:
        child.restarting = True
        task = asyncio.create_task(self._restart_later(child))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart_later(self, child: Child) -> None:
        if time.monotonic() - child.started_at > 60:
            child.restarts = 0  # it was healthy for a while: start the backoff over
        child.restarts += 1
        delay = min(2 ** (child.restarts - 1), 30)
        log.warning("%s exited with %s; restarting in %d s", child.name, child.proc.returncode, delay)
        child.kill_leftovers()
        await asyncio.sleep(delay)
        if not self._stopping.is_set():
            child.start()
        child.restarting = False

    async def _restart_infra(self, child: Child) -> None:
        log.warning("%s exited with %s; restarting it", child.name, child.proc.returncode)
        broker = child.name.startswith("kafka")
        if broker:
            # Before the new broker exists (docs/guide/operations.md): consumers drop their
            # watermarks, and commits decided earlier give up (shared.transport.consume.COMMIT_TIMEOUT_MS).
            await self._bump(RedisKeys.broker_epoch)
            await asyncio.sleep(BROKER_RESTART_GRACE_MS / 1000)
        child.start()
        await _wait_port(child.host, child.port, 20, child)
        if broker:
            # Gateways re-drive only now: tansu hides records produced before their topic exists.
            await ensure_topics(self.settings, fleet_topics(self.settings))
            await self._bump(RedisKeys.broker_ready)

    async def _bump(self, *keys) -> None:
        """Fresh tokens in Redis under ``keys`` (``RedisKeys.broker_epoch`` / ``broker_ready``
        methods): the broker this supervisor runs keeps records in memory only, so a (re)start
        means records in flight were lost."""
        names = RedisKeys(self.settings.redis_prefix)
        redis = make_redis(self.settings)
        try:
            for key in keys:
                await redis.set(key(names), uuid.uuid4().hex)
        except Exception as exc:  # Redis away: gateways cannot re-drive; say so loudly
            log.error("could not record the broker restart in Redis (%r); requests in flight may be lost", exc)
        finally:
            await redis.aclose()

    def request_stop(self) -> None:
        self._stopping.set()

    async def release(self) -> None:
        """After ``stop()``: pending restarts cancelled, the fleet's claims given back."""
        await self._cancel_restarts()
        if self._claim_task is not None:
            self._claim_task.cancel()
            await asyncio.gather(self._claim_task, return_exceptions=True)
        await self.claims.release()

    def stop(self) -> None:
        """Idempotent: services first, all at once (each drains within its own bound, so the
        fleet stops within one ``stop_timeout_s``, not one per service), then Redis and the broker."""
        self._stopping.set()
        for child in self.services:
            child.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for child in reversed(self.services):
            child.stop(max(deadline - time.monotonic(), 0.1))
        if self.zygote is not None:
            self.zygote.stop()
        for child in reversed(self.infra):
            child.stop(self.stop_timeout_s)


async def run_up(settings: Settings, *, mode: str, log_dir: Path | None, ready_file: Path | None = None,
                 autoscale: bool = False) -> int:
    fleet = Fleet(settings, mode=mode, log_dir=log_dir)
    scaler: asyncio.Task | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, fleet.request_stop)
    try:
        start = asyncio.create_task(fleet.start())
        stopper = asyncio.create_task(fleet._stopping.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            try:
                start.result()
            except CannotStart as exc:
                print(f"mmfleet up: cannot start: {exc}", file=sys.stderr)
                return 2
            gcpolicy.serving()
            if ready_file is not None:  # for scripts and tests: the whole fleet serves now
                ready_file.write_text(fleet.claims.info.gateway_url + "\n")
            if autoscale:  # services/autoscale.py: workers per stage group from lag and TTFT
                from services.autoscale import Autoscaler

                scaler = asyncio.create_task(Autoscaler(fleet).run(), name="autoscale")
            await fleet.supervise()
        else:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
        stopper.cancel()
        return 0
    finally:
        if scaler is not None:
            scaler.cancel()
            await asyncio.gather(scaler, return_exceptions=True)
        await asyncio.to_thread(fleet.stop)
        await fleet.release()
