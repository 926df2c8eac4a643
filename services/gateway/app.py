"""The OpenAI-compatible HTTP gateway.

Per request: validate → admission → build the prompt → hold inline media in the gateway's
NIXL pool → produce to ``mm.media-fetch`` (media present) or ``mm.prefill`` → follow the
request's Redis token stream → SSE chunks or one JSON body.

The response status is decided by the stream's first event: an ``ErrorEvent`` before any
token becomes a proper HTTP error (so a bad image is a 400 even for ``stream=true``); after
the first token, errors arrive as an SSE ``error`` object, which the openai client raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import redis.asyncio as aioredis
import torch
from aiohttp import web
from aiokafka.errors import KafkaError

from shared import protocol
from shared.bus import make_producer
from shared.keys import RedisKeys
from shared.ledger import StageLedger
from shared.models.registry import resolve_model_path
from shared.settings import Settings
from shared.stage import Produce, RequestFailed, entry_message
from shared.streams import TokenStreams
from shared.transfer import PoolFullError, TransferAgent
from services.gateway import schema
from services.gateway.prompt import Prepared, PromptBuilder
from services.gateway.responses import Shaper, error_response, event_error_response, sse_response, whole_response

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
STATE = web.AppKey("state", "GatewayState")


class GatewayState:
    """Everything the handlers share; built in ``cleanup_ctx`` and torn down there."""

    def __init__(self, settings: Settings, builder: PromptBuilder, producer, redis, streams: TokenStreams,
                 transfer: TransferAgent) -> None:
        self.settings = settings
        self.builder = builder
        self.producer = producer
        self.redis = redis
        self.streams = streams
        self.transfer = transfer
        self.inflight = 0
        self.ledger = StageLedger(redis, RedisKeys(settings.redis_prefix), lease_ms=settings.stage_lease_ms,
                                  done_ttl_s=settings.done_ttl_s)


async def _lifecycle(app: web.Application):
    settings = app[SETTINGS]
    builder = PromptBuilder.for_model(resolve_model_path(settings), settings)
    producer = make_producer(settings)
    redis = aioredis.from_url(settings.redis_url)
    transfer = TransferAgent(f"gateway-{uuid.uuid4().hex[:12]}", settings.pool_bytes,
                             lease_ttl_ms=settings.lease_ttl_ms)
    await producer.start()
    await transfer.start()
    streams = TokenStreams(redis, RedisKeys(settings.redis_prefix), maxlen=settings.stream_maxlen,
                           ttl_s=settings.stream_ttl_s)
    app[STATE] = GatewayState(settings, builder, producer, redis, streams, transfer)
    try:
        yield
    finally:
        await transfer.stop()
        await producer.stop()
        await redis.aclose()


def create_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app


# ---------------------------------------------------------------------- routes
async def models(request: web.Request) -> web.Response:
    s = request.app[SETTINGS]
    return web.json_response({"object": "list", "data": [
        {"id": s.served_model_name, "object": "model", "created": 0, "owned_by": "mmfleet"}]})


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers and the producer knows at least one broker."""
    state = request.app[STATE]
    problems = []
    try:
        await asyncio.wait_for(state.redis.ping(), 2)
    except Exception as exc:  # any failure means not ready; say which
        problems.append(f"redis: {type(exc).__name__}")
    try:
        await asyncio.wait_for(state.producer.client.force_metadata_update(), 2)
        if not state.producer.client.cluster.brokers():
            problems.append("kafka: no brokers")
    except Exception as exc:
        problems.append(f"kafka: {type(exc).__name__}")
    if problems:
        return web.json_response({"status": "unavailable", "problems": problems}, status=503)
    return web.json_response({"status": "ready"})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


# ---------------------------------------------------------------------- one request
async def _serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    s = state.settings
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body is larger than {s.max_request_bytes} bytes",
                              code="request_too_large")
    try:
        req = schema.parse_chat(body) if chat else schema.parse_completion(body)
        prepared = state.builder.chat(req) if chat else state.builder.completion(req)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"invalid request body: {exc}")
    except RequestFailed as failed:
        return event_error_response(failed.event)
    if state.inflight >= s.max_inflight_requests:
        return error_response(429, f"server is at its limit of {s.max_inflight_requests} in-flight requests; "
                                   "retry shortly", code="overloaded", headers={"Retry-After": "1"})
    state.inflight += 1
    try:
        return await _run(request, state, prepared, req.model, chat=chat)
    finally:
        state.inflight -= 1


async def _run(request: web.Request, state: GatewayState, prepared: Prepared, model: str, *,
               chat: bool) -> web.StreamResponse:
    s = state.settings
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    now_ms = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id=request_id, model=model, created_unix_ms=now_ms,
                                deadline_unix_ms=now_ms + s.request_timeout_ms,
                                prompt_token_ids=tuple(prepared.prompt_token_ids), sampling=prepared.sampling)
    try:
        first = await _first_message(state, meta, prepared)
    except PoolFullError:
        return error_response(429, "server media buffers are full; retry shortly", code="overloaded",
                              headers={"Retry-After": "1"})
    meta = first.value.meta
    inline = [it.inline.lease for it in meta.sources if it.inline is not None]
    try:
        try:
            await state.producer.send_and_wait(first.topic, protocol.encode(first.value), key=request_id.encode())
        except KafkaError as exc:  # broker down or restarting: say so, never an unshaped 500
            log.warning("could not queue %s on %s: %r", request_id, first.topic, exc)
            return error_response(503, f"the request queue is unavailable right now ({type(exc).__name__}); "
                                       "retry shortly", code="queue_unavailable", headers={"Retry-After": "1"})
        return await _respond(request, state, meta, prepared, model, chat=chat)
    except (asyncio.CancelledError, ConnectionResetError):
        # the client went away: tell the stages to stop working on it
        await asyncio.shield(state.ledger.abort(request_id, ttl_s=s.stream_ttl_s))
        raise
    finally:
        for lease in inline:  # held until the end: a restart from the source re-reads them
            state.transfer.free_local(lease)


async def _respond(request: web.Request, state: GatewayState, meta: protocol.RequestMeta, prepared: Prepared,
                   model: str, *, chat: bool) -> web.StreamResponse:
    s = state.settings
    request_id = meta.request_id

    loop = asyncio.get_running_loop()
    events = state.streams.follow(request_id, deadline_s=loop.time() + s.request_timeout_ms / 1000)
    shaper = Shaper(request_id, model, chat=chat)
    try:
        first = await anext(events)
        if isinstance(first, protocol.ErrorEvent):
            return event_error_response(first)
        if prepared.stream:
            return await sse_response(request, shaper, first, events, prepared.include_usage)
        return await whole_response(shaper, first, events)
    except TimeoutError:
        return error_response(504, f"request {request_id} did not finish within {s.request_timeout_ms} ms",
                              code="deadline_exceeded")
    finally:
        await events.aclose()


async def _first_message(state: GatewayState, meta: protocol.RequestMeta, prepared: Prepared) -> Produce:
    """The request's entry message; its meta records the media sources (see runner restarts)."""
    items = []
    has_inline = False
    for m in prepared.media:
        if m.data is not None:
            has_inline = True
            ref = await state.transfer.put_wait(torch.frombuffer(bytearray(m.data), dtype=torch.uint8),
                                                timeout_ms=2_000)
            items.append(protocol.MediaSource(kind=m.kind, param=m.param, inline=ref, mime=m.mime,
                                              num_frames=m.num_frames, fps=m.fps, grid_thw=m.grid_thw))
        else:
            items.append(protocol.MediaSource(kind=m.kind, param=m.param, url=m.url, num_frames=m.num_frames,
                                              fps=m.fps))
    owner = state.transfer.ref() if has_inline else None
    return entry_message(msgspec.structs.replace(meta, sources=tuple(items), source_owner=owner))
