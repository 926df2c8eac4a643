"""The fleet's engine in ONE process, behind the same OpenAI surface: the ``inproc`` baseline.

Same code as the fleet wherever the fleet has code (request schema, ``PromptBuilder``, media
policy, the model's preprocessor on a lane of its own, ``TransformersEngine``,
``stream_completion``, the gateway's ``Shaper``); no Kafka, Redis, NIXL or process boundary, so
its difference from ``mmfleet up`` is the fleet's cost. Routes: ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``POST /spans`` (the last ``SPANS_KEPT`` requests' steps in
the fleet's span vocabulary). The model loads before the port opens: listening means ready.
Run: ``python -m loadtest inproc --port 8200 [--model-dir DIR]``. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections import OrderedDict

import msgspec
import torch
from aiohttp import web

from services.gateway import schema
from services.gateway.prompt import Prepared, PromptBuilder
from services.gateway.responses import Shaper, error_response, event_error_response, sse_response, whole_response
from shared import protocol
from shared.engines.registry import make_engine
from shared.engines.token_stream import stream_completion
from shared.process import aio
from shared.settings import Settings
from shared.stage import RequestFailed

log = logging.getLogger("loadtest.inproc")
SETTINGS = web.AppKey("settings", Settings)
STATE = web.AppKey("state", "InprocState")
SPANS_KEPT = 50_000


class QueueSink:
    """The ``EventSink`` of one request: events go to a queue the HTTP handler drains."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[protocol.StreamEvent] = asyncio.Queue()

    async def append(self, request_id: str, event: protocol.StreamEvent) -> None:
        self.queue.put_nowait(event)

    async def append_delta(self, request_id: str, delta: protocol.TokenDelta, position: int) -> bool:
        self.queue.put_nowait(delta)  # one writer per request in-process: always its turn
        return True

    async def events(self):
        """The events as they come, for the gateway's response builders."""
        while True:
            yield await self.queue.get()


class InprocState:
    def __init__(self, settings: Settings, engine, builder: PromptBuilder, fetcher, preprocess, lane) -> None:
        self.settings = settings
        self.engine = engine
        self.builder = builder
        self.fetcher = fetcher
        self.preprocess = preprocess
        self.lane = lane
        # as the epd worker's runner bounds prefill+decode work in flight
        self.generating = asyncio.Semaphore(settings.decode_concurrency)
        self.spans: OrderedDict[str, list[dict]] = OrderedDict()

    def keep_spans(self, request_id: str, spans: list[dict]) -> None:
        self.spans[request_id] = spans
        while len(self.spans) > SPANS_KEPT:
            self.spans.popitem(last=False)


def _span(stage: str, total_s: float, *, queue_s: float = 0.0, transfer_s: float = 0.0) -> dict:
    return {"stage": stage, "worker": "inproc", "queue_ms": queue_s * 1000, "transfer_ms": transfer_s * 1000,
            "compute_ms": max(0.0, total_s - transfer_s) * 1000, "total_ms": total_s * 1000}


async def _lifecycle(app: web.Application):
    from shared.engines.qwen2_vl import ImagePreprocessor
    from shared.media.fetch import MediaFetcher
    from shared.models.registry import resolve_model_path
    from shared.process.compute import ComputeLane

    s = app[SETTINGS]
    model_dir = resolve_model_path(s)
    engine = make_engine("transformers", s, model_dir)  # as a worker builds it
    await engine.start()
    # as the gateway builds it, for the modality this baseline serves (images)
    builder = PromptBuilder.for_model(model_dir, s, only=frozenset({"image"}))
    lane = ComputeLane("media", inline_max_ms=s.compute_inline_max_ms)  # as media-fetch builds it
    async with MediaFetcher.from_settings(s) as fetcher:
        app[STATE] = InprocState(s, engine, builder, fetcher, ImagePreprocessor(model_dir), lane)
        log.info("inproc server ready (model %s)", model_dir)
        try:
            yield
        finally:
            lane.close()
            await engine.stop()


def create_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.max_request_bytes)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/spans", spans)
    app.router.add_get("/metrics", prom_metrics)  # the engine's own metrics (e.g. decode batch sizes)
    return app


async def prom_metrics(_request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def spans(request: web.Request) -> web.Response:
    kept = request.app[STATE].spans
    ids = (await request.json()).get("ids", [])
    return web.json_response({i: kept[i] for i in ids if i in kept})


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS].served_model_name
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                          "owned_by": "mmfleet-inproc"}]})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        req = schema.parse_chat(await request.read())
        prepared = state.builder.chat(req)
        images, media_spans = await _images(state, prepared)
        prompt_len = len(prepared.prompt_token_ids) + sum(int(e.shape[0]) - 1 for e, _ in images)
        if prompt_len + prepared.sampling.max_tokens > state.engine.max_model_len:
            raise RequestFailed.bad_request(
                f"prompt ({prompt_len} tokens with media) plus max_tokens ({prepared.sampling.max_tokens}) exceeds "
                f"the model's context of {state.engine.max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return error_response(400, f"invalid request body: {exc}")
    except RequestFailed as failed:
        return event_error_response(failed.event)
    request_id = "chatcmpl-" + uuid.uuid4().hex
    now_ms = int(time.time() * 1000)
    meta = protocol.RequestMeta(request_id=request_id, model=req.model, created_unix_ms=now_ms,
                                deadline_unix_ms=now_ms + state.settings.request_timeout_ms,
                                prompt_token_ids=tuple(prepared.prompt_token_ids), sampling=prepared.sampling)
    sink = QueueSink()
    task = asyncio.create_task(_generate(state, meta, images, prompt_len, sink, media_spans))
    shaper = Shaper(request_id, req.model, chat=True)
    try:
        first = await sink.queue.get()
        if isinstance(first, protocol.ErrorEvent):
            return event_error_response(first)
        if prepared.stream:
            return await sse_response(request, shaper, first, sink.events(), prepared.include_usage)
        return await whole_response(shaper, first, sink.events())
    finally:  # client gone or done: closing the generation aborts it in the engine
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _images(state: InprocState, prepared: Prepared) -> tuple[list[tuple[torch.Tensor, tuple[int, int, int]]],
                                                                 list[dict]]:
    """Fetch + decode + preprocess each item in order (as media-fetch), then encode them all
    concurrently (as encode: the engine batches them into one forward). Also returns the
    media-fetch and encode spans (none for a text-only request)."""
    from shared.media.images import decode_image
    from shared.media.sources import MediaError

    if not prepared.media:
        return [], []
    s = state.settings
    pixels = []
    t0 = time.perf_counter()
    fetch_s = 0.0
    try:
        for m in prepared.media:
            raw = m.data
            if raw is None:
                f0 = time.perf_counter()
                raw = await state.fetcher.fetch(m.url, max_bytes=s.max_image_bytes, param=m.param)
                fetch_s += time.perf_counter() - f0

            def prep(raw=raw, param=m.param):
                return state.preprocess(decode_image(raw, max_pixels=s.max_image_pixels, param=param))

            pixels.append(await state.lane.run(prep, size=len(raw)))
    except MediaError as exc:
        raise RequestFailed(exc.status, str(exc), code=exc.code) from None
    t1 = time.perf_counter()
    embeds = await asyncio.gather(*(state.engine.encode(px.pixel_values, px.grid_thw, px.n_tokens) for px in pixels))
    spans = [_span("media-fetch", t1 - t0, transfer_s=fetch_s), _span("encode", time.perf_counter() - t1)]
    return [(emb, px.grid_thw) for emb, px in zip(embeds, pixels, strict=True)], spans


async def _generate(state: InprocState, meta: protocol.RequestMeta, images, prompt_len: int, sink: QueueSink,
                    media_spans: list[dict]) -> None:
    engine = state.engine
    marks: list[float] = []  # token times: the first ends prefill, the last ends decode

    async def timed(tokens):
        try:
            async for t in tokens:
                marks.append(time.perf_counter())
                yield t
        finally:
            await tokens.aclose()  # closing the wrapper must still abort the engine's generation

    try:
        t0 = time.perf_counter()
        async with state.generating:
            t1 = time.perf_counter()
            tokens = timed(engine.generate(meta.request_id, list(meta.prompt_token_ids), images, meta.sampling))
            await stream_completion(sink, meta, tokens, tokenizer=engine.tokenizer,
                                    eos_token_ids=engine.eos_token_ids, prompt_len=prompt_len)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the request fails, the server goes on (as a stage would)
        log.exception("request %s failed", meta.request_id)
        await sink.append(meta.request_id, protocol.ErrorEvent(status=500, type="server_error", message=repr(exc)))
        return
    if marks:
        state.keep_spans(meta.request_id, media_spans + [_span("prefill", marks[0] - t1, queue_s=t1 - t0),
                                                         _span("decode", marks[-1] - marks[0])])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--model-dir", help="model directory (default: MMFLEET_MODEL_PATH or the demo model)")


def serve_main(args: argparse.Namespace) -> int:
    from shared import settings as settings_mod

    settings = settings_mod.from_env(model=args.model_dir, gateway_host=args.host, gateway_port=args.port)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    torch.set_num_threads(settings.torch_threads)
    factory = aio.loop_factory(settings.event_loop)  # the fleet's loop: the same engine, like for like
    web.run_app(create_app(settings), host=args.host, port=args.port, access_log=None, print=None,
                loop=factory() if factory else None)
    return 0
