"""The gateway's live fleet page: ``GET /fleet`` (the page), ``/fleet/static/*`` (its script and
style, shipped in this package: no build step, nothing from a CDN) and ``GET /fleet/snapshot``
(the :class:`~services.fleetview.snapshot.FleetSnapshot` as JSON, which the page polls).

The snapshot follows the API's key rule (``services/gateway/auth.py``: 401 without a configured
key) but is not charged against the key's rate. The page holds no fleet data: a browser cannot
attach a bearer header to a navigation, so the page asks for the key once (kept in the tab's
``sessionStorage``) and sends it with every poll. Design: docs/guide/observability.md.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from aiohttp import web

from services.fleetview.collect import FleetCollector
from services.gateway.auth import Authenticator
from services.gateway.responses import Rejected
from shared.keys import RedisKeys
from shared.settings import Settings
from shared.transport.redis_conn import make_redis

STATIC = Path(__file__).parent / "static"
_FILES = {"fleet.js": "text/javascript", "fleet.css": "text/css"}
COLLECTOR = web.AppKey("fleet_collector", FleetCollector)
AUTH = web.AppKey("fleet_auth", Authenticator)
_encoder = msgspec.json.Encoder()


def add_routes(app: web.Application, settings: Settings) -> None:
    """Mount the page on ``app`` (the gateway's); the collector lives as long as the app."""

    async def lifecycle(app: web.Application):
        redis = make_redis(settings)
        keys = RedisKeys(settings.redis_prefix)
        app[AUTH] = Authenticator(settings, redis, keys)
        app[COLLECTOR] = FleetCollector(redis, keys, pool_bytes=settings.pool_bytes)
        try:
            yield
        finally:
            await app[COLLECTOR].close()
            await redis.aclose()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/fleet", page)
    app.router.add_get("/fleet/static/{name}", static)
    app.router.add_get("/fleet/snapshot", snapshot)


async def page(_request: web.Request) -> web.Response:
    return web.Response(body=(STATIC / "fleet.html").read_bytes(), content_type="text/html",
                        headers={"Cache-Control": "no-cache"})


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _FILES:  # a fixed list: no path from the URL reaches the file system
        raise web.HTTPNotFound()
    return web.Response(body=(STATIC / name).read_bytes(), content_type=_FILES[name],
                        headers={"Cache-Control": "no-cache"})


async def snapshot(request: web.Request) -> web.Response:
    try:
        request.app[AUTH].identify(request.headers.get("Authorization"), via="fleet")
    except Rejected as rejected:
        return rejected.response()
    snap = await request.app[COLLECTOR].snapshot()
    return web.Response(body=_encoder.encode(snap), content_type="application/json",
                        headers={"Cache-Control": "no-store"})
