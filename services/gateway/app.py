"""The OpenAI-compatible HTTP gateway (and, in the same process, the Kafka ingress).

A request goes through ``frontend.py`` (shared with the ingress): authenticate → validate →
admission → inline media into the gateway's NIXL pool → produce to ``mm.media-fetch`` or
``mm.prefill`` → follow its Redis token stream → SSE chunks or one JSON body. An error before
the first token is an HTTP error (a bad image is a 400 even with ``stream=true``); after it, an
SSE ``error`` object. Every answer counts in ``mmfleet_requests_total{status}`` (499: the client
left first) and is logged with its request id; ``GET /metrics`` serves the registry.
Design: docs/guide/api.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import orjson
from aiohttp import web

from services.fleetview import page as fleet_page
from services.gateway.auth import Authenticator
from services.gateway.frontend import Frontend, new_request_id
from services.gateway.media_names import MediaNames
from services.gateway.media_tokens import MediaTokens
from services.gateway.prompt import PromptBuilder
from services.gateway.readiness import readiness, request_paths
from services.gateway.responses import ClientGone, Rejected, error_response, http_reply
from services.gateway.tokenize import Tokenization
from services.version import version as mmfleet_version
from shared import logs, metrics
from shared.keys import INGRESS_STAGE, RedisKeys
from shared.kv.router import Router
from shared.models.registry import placeholder_token_id, resolve_model_path
from shared.process import hostaddr
from shared.settings import Settings
from shared.transfer import TransferAgent
from shared.transport.bus import make_producer
from shared.transport.doorbell import Doorbell
from shared.transport.ledger import StageLedger
from shared.transport.redis_conn import make_redis
from shared.transport.redis_lean import lean_of
from shared.transport.streams import TokenStreams

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
STATE = web.AppKey("state", "GatewayState")
GATEWAY_ID = web.AppKey("gateway_id", str)
TOKENS = web.AppKey("tokens", Tokenization)


class GatewayState:
    """Everything the handlers share; built in ``cleanup_ctx`` and torn down there."""

    def __init__(self, settings: Settings, front: Frontend, producer, redis, keys: RedisKeys) -> None:
        self.settings = settings
        self.front = front
        self.producer = producer
        self.redis = redis
        self.keys = keys
        # what /ready requires: the stages of every request kind this model takes
        self.paths = request_paths(front.builder.modalities)


async def _media_names(settings: Settings, redis, keys: RedisKeys) -> MediaNames:
    """The resolver of data-less client-named items: the fleet's embedding index (none with the
    cache off) and the model's fingerprint, as media-fetch keys items."""
    if settings.embedding_cache_bytes <= 0:
        return MediaNames(None, "")
    from shared.embcache.identity import model_fingerprint
    from shared.embcache.index import EmbeddingIndex

    index = EmbeddingIndex(redis, keys, ttl_s=settings.embedding_index_ttl_s,
                           lease_ms=settings.embedding_coalesce_lease_ms)
    return MediaNames(index, await asyncio.to_thread(model_fingerprint, resolve_model_path(settings)))


async def _lifecycle(app: web.Application):
    settings = app[SETTINGS]
    keys = RedisKeys(settings.redis_prefix)
    builder = PromptBuilder.for_model(resolve_model_path(settings), settings)
    producer = make_producer(settings)
    redis = make_redis(settings)
    auth = Authenticator(settings, redis, keys)
    gateway_id = app[GATEWAY_ID]
    transfer = TransferAgent(gateway_id, settings.pool_bytes, lease_ttl_ms=settings.lease_ttl_ms,
                             host=hostaddr.advertise_host(settings, settings.gateway_host),
                             shared_pool=settings.transfer_host_shm,
                             progress_wake_ms=settings.nixl_progress_wake_ms)
    await producer.start()
    await transfer.start()
    metrics.watch_pool(transfer)
    streams = TokenStreams(redis, keys, maxlen=settings.stream_maxlen, ttl_s=settings.stream_ttl_s)
    ledger = StageLedger(redis, keys, lease_ms=settings.stage_lease_ms, done_ttl_s=settings.done_ttl_s)
    # text-only requests enter at mm.prefill: KV-aware routing picks the partition
    # an unavailable Redis fails the request (a 503) rather than routing by key: its stream lives there
    router = Router(redis, keys, settings, placeholder_token_id(resolve_model_path(settings)), redis_required=True)
    doorbell = Doorbell(redis, settings.redis_prefix, idle_fetch_interval_ms=settings.idle_fetch_interval_ms) \
        if settings.doorbell else None
    front = Frontend(settings, builder, producer, streams, transfer, auth, ledger, router, doorbell,
                     names=await _media_names(settings, redis, keys))
    app[STATE] = GatewayState(settings, front, producer, redis, keys)
    app[TOKENS] = Tokenization(builder, settings, MediaTokens.for_model(resolve_model_path(settings),
                                                                        max_image_pixels=settings.max_image_pixels))
    redrive_task = asyncio.create_task(front.redriver.run(), name="redrive")
    ingress_task = None
    if settings.ingress_enabled:
        from services.gateway.ingress import Ingress

        claims = StageLedger(redis, keys, lease_ms=settings.stage_lease_ms, done_ttl_s=settings.ingress_dedupe_ttl_s)
        ingress = Ingress(front, claims, owner=gateway_id)
        ingress_task = asyncio.create_task(ingress.run(), name=INGRESS_STAGE)
    try:
        yield
    finally:
        redrive_task.cancel()
        await asyncio.gather(redrive_task, return_exceptions=True)
        if ingress_task is not None:
            ingress.stop()
            await asyncio.gather(ingress_task, return_exceptions=True)
        front.close()
        if doorbell is not None:
            await doorbell.close()
        await streams.close()
        await transfer.stop()
        await producer.stop()
        await lean_of(redis).close()
        await redis.aclose()


def create_app(settings: Settings, gateway_id: str | None = None) -> web.Application:
    """``gateway_id``: this process's one id (its liveness record, NIXL agent and ingress claims)."""
    app = web.Application(client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app[GATEWAY_ID] = gateway_id or f"gateway-{uuid.uuid4().hex[:12]}"
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", show_version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics.metrics_view)
    fleet_page.add_routes(app, settings)  # /fleet: the live operator page (services/fleetview)
    return app


# ---------------------------------------------------------------------- routes
def _model_card(s: Settings) -> dict:
    return {"id": s.served_model_name, "object": "model", "created": 0, "owned_by": "mmfleet"}


async def models(request: web.Request) -> web.Response:
    """The served model, under the same API-key rule as the completions routes."""
    try:
        request.app[STATE].front.auth.identify(request.headers.get("Authorization"), via="http")
    except Rejected as rejected:
        return rejected.response()
    return web.json_response({"object": "list", "data": [_model_card(request.app[SETTINGS])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the served model's card, or OpenAI's 404 ``model_not_found``."""
    try:
        request.app[STATE].front.auth.identify(request.headers.get("Authorization"), via="http")
    except Rejected as rejected:
        return rejected.response()
    s = request.app[SETTINGS]
    name = request.match_info["model"]
    if name != s.served_model_name:
        return error_response(404, f"The model {name!r} does not exist", param="model", code="model_not_found")
    return web.json_response(_model_card(s))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` (services/gateway/tokenize.py), under the API-key rule of /v1/models."""
    return await _answer_here(request, request.app[TOKENS].tokenize)


async def detokenize(request: web.Request) -> web.Response:
    return await _answer_here(request, request.app[TOKENS].detokenize)


async def _answer_here(request: web.Request, answer) -> web.Response:
    front = request.app[STATE].front
    try:
        body = await front.answer_here(functools.partial(_read_body, request, front.settings), answer,
                                       authorization=request.headers.get("Authorization"), via="http")
    except Rejected as rejected:
        return rejected.response()
    except ClientGone as gone:
        return gone.response
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def show_version(request: web.Request) -> web.Response:
    """``{"version": ...}`` as vLLM's ``GET /version`` answers, with mmfleet's version."""
    try:
        request.app[STATE].front.auth.identify(request.headers.get("Authorization"), via="http")
    except Rejected as rejected:
        return rejected.response()
    return web.json_response({"version": mmfleet_version()})


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 when a request of each kind served can be answered now, else 503 naming what is
    missing (services/gateway/readiness.py)."""
    state = request.app[STATE]
    status, body = await readiness(state.redis, state.producer, state.keys, state.paths)
    return web.json_response(body, status=status)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


# ---------------------------------------------------------------------- one request
async def _serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    """One request, counted by its status and logged once with its request id."""
    t0 = time.perf_counter()
    request_id = new_request_id(chat)
    status = 500
    with logs.bind(request_id=request_id):
        try:
            resp = await _admit(request, request_id, t0, chat=chat)
            status = resp.status
            if status == 200:
                metrics.E2E.observe(time.perf_counter() - t0)
            return resp
        except ClientGone as gone:  # the request was aborted upstream; aiohttp ends the stream quietly
            status = 499
            return gone.response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away before the answer was complete
            raise
        finally:
            metrics.REQUESTS.labels(str(status)).inc()
            log.info("%s %s %d %.1f ms", request.method, request.path, status, (time.perf_counter() - t0) * 1000)


async def _read_body(request: web.Request, settings: Settings) -> bytes:
    """Read once the key and the admission let the request in."""
    timeout_ms = settings.request_body_timeout_ms
    try:
        # bounded: the request holds an in-flight slot from here, and a slow sender must not keep it
        async with asyncio.timeout(timeout_ms / 1000):
            return await request.read()
    except TimeoutError:
        raise Rejected.of(408, f"the request body did not arrive within {timeout_ms} ms",
                          code="request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise Rejected.of(413, f"request body is larger than {settings.max_request_bytes} bytes",
                          code="request_too_large") from None
    except ConnectionResetError:  # the client left mid-upload: no server error, nothing to log as one
        raise ClientGone(error_response(400, "the request body was not complete",
                                        code="incomplete_body")) from None


async def _admit(request: web.Request, request_id: str, t0: float, *, chat: bool) -> web.StreamResponse:
    front = request.app[STATE].front
    body = functools.partial(_read_body, request, front.settings)
    try:
        async with front.admit(body, chat=chat, authorization=request.headers.get("Authorization"),
                               via="http", request_id=request_id, t0=t0) as adm:
            replies = front.replies(adm)
            try:
                return await http_reply(request, replies, stream=adm.prepared.stream)
            finally:
                await replies.aclose()
    except Rejected as rejected:
        return rejected.response()
