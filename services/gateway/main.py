"""Run the gateway as a process: serve until SIGTERM/SIGINT, then stop accepting and close."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from shared.settings import Settings
from services.gateway.app import create_app

log = logging.getLogger(__name__)


async def run_gateway(settings: Settings) -> int:
    runner = web.AppRunner(create_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port)
    await site.start()
    log.info("gateway listening on http://%s:%d", settings.gateway_host, settings.gateway_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
