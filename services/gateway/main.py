"""Run the gateway as a process: serve until SIGTERM/SIGINT, then stop accepting and close.

While it listens, the gateway keeps a liveness record (``GatewayInfo``: its URL, which also
serves ``/metrics``) in Redis, so operators and tests find every process of the fleet there.

Design: docs/design/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid

from aiohttp import web

from services.gateway.app import create_app
from shared import logs, protocol
from shared.keys import RedisKeys
from shared.models.registry import resolve_model_path
from shared.process import gcpolicy, hostaddr
from shared.settings import Settings
from shared.transport.liveness import keep_record
from shared.transport.redis_conn import make_redis

log = logging.getLogger(__name__)


def advertised_url(settings: Settings, port: int) -> str:
    """The URL others reach this gateway at (``advertise_host``, else the bind address; a
    wildcard bind is advertised by host name)."""
    return hostaddr.http_url(hostaddr.advertise_host(settings, settings.gateway_host), port)


async def run_gateway(settings: Settings) -> int:
    gateway_id = f"gateway-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs.set_process(gateway_id)
    try:  # once, before anything starts: a model not there is a start-up error naming it
        settings = settings.with_overrides(model=str(resolve_model_path(settings)))
    except ValueError as exc:
        raise SystemExit(f"cannot start gateway: {exc}") from None
    # before the app's NIXL agent exists (UCX reads it then)
    os.environ.update(hostaddr.ucx_env(settings, settings.gateway_host))
    runner = web.AppRunner(create_app(settings, gateway_id), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port)
    await site.start()
    port = runner.addresses[0][1]  # the bound one, when gateway_port is 0
    url = advertised_url(settings, port)
    log.info("gateway listening on %s (metrics on %s/metrics)", url, url)
    gcpolicy.serving()  # the app started: the collector back on, start-up's heap frozen
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    redis = make_redis(settings)
    info = protocol.GatewayInfo(gateway_id=gateway_id, url=url, pid=os.getpid(),
                                host=hostaddr.advertise_host(settings, settings.gateway_host),
                                started_unix_ms=int(time.time() * 1000))
    keys = RedisKeys(settings.redis_prefix)
    record = asyncio.create_task(keep_record(redis, keys.gateway(gateway_id), protocol.encode(info), lambda: True,
                                             index=keys.gateways_index()))
    try:
        await stop.wait()
    finally:
        record.cancel()
        await asyncio.gather(record, return_exceptions=True)
        await redis.aclose()
        await runner.cleanup()
    return 0
