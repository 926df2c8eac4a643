"""The one code path by which a request enters the fleet: HTTP (``app.py``) and the Kafka
ingress (``ingress.py``) both call :meth:`Frontend.admit` and :meth:`Frontend.replies`, so they
check, refuse and answer alike. In order, each before anything after it costs: the API key
(401); admission, the in-flight bound (429 ``overloaded``) before the key's rate (429
``rate_limit_exceeded``: a request refused for load uses no quota); only then the body is read
(HTTP) and parsed with its prompt (400/404/413 naming the field, see ``params``); inline
``data:`` media into the NIXL pool (429 when full) and the entry message (413 too large to
queue, 503 when the broker or Redis is unavailable). These raise :class:`Rejected`. Then the
answer: the token stream shaped by ``responses.shape_replies``; from there every outcome is a reply.
Design: docs/guide/api.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import msgspec
import torch
from aiokafka.errors import KafkaError

from services.gateway import bounds, params, schema
from services.gateway.auth import Authenticator
from services.gateway.media_names import MediaNames, cache_scope
from services.gateway.prompt import Prepared, PromptBuilder
from services.gateway.redrive import Redriver
from services.gateway.responses import (
    STORE_RETRY_AFTER_S,
    Rejected,
    Reply,
    Shaper,
    error_reply,
    shape_replies,
    store_unavailable,
)
from shared import metrics, protocol
from shared.settings import Settings
from shared.stage import RequestFailed, entry_message
from shared.transfer import PoolFullError, TransferAgent
from shared.transport.bus import TOO_LARGE, produce_entry
from shared.transport.ledger import StageLedger
from shared.transport.redis_conn import unavailable
from shared.transport.streams import TokenStreams

log = logging.getLogger(__name__)
# threads that prepare requests (parse, render, tokenize): two, so one costly request does not hold
# up every other; more gain nothing while the GIL serialises the Python half of the work
PREPARE_THREADS = 2


@dataclass(frozen=True)
class Admitted:
    """A request that is in the fleet: its entry message is acknowledged by the broker."""

    request_id: str
    model: str
    chat: bool
    prepared: Prepared
    key_id: str | None
    t0: float = 0.0  # perf_counter() when the request arrived (time to first token counts from it)


class Frontend:
    """Shared by every way in of one gateway process (one in-flight count for all of them)."""

    def __init__(self, settings: Settings, builder: PromptBuilder, producer, streams: TokenStreams,
                 transfer: TransferAgent, auth: Authenticator, ledger: StageLedger, router=None,
                 doorbell=None, names: MediaNames | None = None) -> None:
        self.settings = settings
        self.builder = builder
        self.producer = producer
        self.streams = streams
        self.transfer = transfer
        self.auth = auth
        self.ledger = ledger
        self.inflight = 0
        self.router = router  # shared.kv.router.Router for entries at mm.prefill (None: by key)
        self.doorbell = doorbell  # shared.transport.doorbell.Doorbell: rung once an entry record is acked
        self.names = names or MediaNames(None, "")  # data-less client-named items, resolved before admitting
        # its run() is started by the gateway app
        self.redriver = Redriver(ledger, producer, router=router, doorbell=doorbell)
        self._aborting: set[asyncio.Task] = set()  # abort marks on their way (one per request at most)
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="gateway-prepare")
        self._answering = 0  # requests the gateway answers itself (answer_here), waiting or on the pool

    def close(self) -> None:
        """Idempotent; the app's cleanup calls it once the server takes no more requests."""
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def prepare(self, body: bytes, *, chat: bool) -> tuple[Prepared, str]:
        """Validate ``body`` and build its prompt: (prepared, model); raises ``Rejected``."""
        s = self.settings
        with rejections():
            req, sent = bounds.decode_bounded(body, s, chat=chat, context_tokens=self.builder.context_tokens)
            if schema.too_deep(schema.free_form(req, chat=chat)):
                raise too_deep()
            unknown = [] if s.allow_extra_request_fields else schema.unknown_fields(sent, chat=chat)
            if unknown:
                raise unknown_field(unknown[0])
            params.check_fields(req, chat=chat)
            prepared = self.builder.chat(req) if chat else self.builder.completion(req)
        return prepared, req.model

    async def answer_here(self, body: Callable[[], Awaitable[bytes]], answer: Callable[[bytes], dict], *,
                          authorization: str | None, via: str) -> dict:
        """A request the gateway answers itself (/tokenize, /detokenize): the API key as for
        /v1/models; at most ``max_inflight_requests`` of them at once (429 ``overloaded``: each
        holds its body while it waits for the pool); the body read only then; ``answer(body)`` on
        the preparation pool. Raises ``Rejected``."""
        self.auth.identify(authorization, via=via)
        if self._answering >= self.settings.max_inflight_requests:
            metrics.ADMISSION_REJECTIONS.labels("inflight_limit").inc()
            raise Rejected.of(429, f"server is at its limit of {self.settings.max_inflight_requests} requests it "
                                   "answers itself; retry shortly", code="overloaded", retry_after_s=1)
        self._answering += 1  # taken with the check (no await between them)
        try:
            raw = await body()
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, functools.partial(answer, raw))
        finally:
            self._answering -= 1

    @asynccontextmanager
    async def admit(self, body: bytes | Callable[[], Awaitable[bytes]], *, chat: bool, authorization: str | None,
                    via: str, request_id: str | None = None, t0: float | None = None) -> AsyncIterator[Admitted]:
        """Steps 1-4 (see the module docstring); raises ``Rejected``. ``body``: the bytes, or how
        to read them (HTTP), called only once the key and the admission let the request in.
        Inside the block the request runs; leaving it frees the request's inline media and its
        in-flight slot. A cancelled block (the client went away) tells the stages to abort it."""
        s = self.settings
        t0 = time.perf_counter() if t0 is None else t0
        key_id = self.auth.identify(authorization, via=via)
        if self.inflight >= s.max_inflight_requests:
            metrics.ADMISSION_REJECTIONS.labels("inflight_limit").inc()
            raise Rejected.of(429, f"server is at its limit of {s.max_inflight_requests} in-flight requests; "
                                   "retry shortly", code="overloaded", retry_after_s=1)
        self.inflight += 1  # taken with the check (no await between them), given back below
        metrics.INFLIGHT.inc()
        leases: list[int] = []
        request_id = request_id or new_request_id(chat)
        try:
            await self.auth.charge(key_id, via=via)
            raw = body if isinstance(body, bytes) else await body()
            # parsing, rendering, tokenizing and grammar checks cost CPU in proportion to the body
            # (bounded by services.gateway.bounds): never on the loop that answers /health and streams
            prepared, model = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, functools.partial(self.prepare, raw, chat=chat))
            scope = cache_scope(key_id, prepared.cache_salt, share_across_tenants=s.cache_share_across_tenants)
            await self.names.check(prepared.media, scope)
            first = await self._entry(request_id, model, prepared, leases, scope)
            self.redriver.track(first.value.meta)
            try:
                now_ms = int(time.time() * 1000)
                # queue_retry_ms bounds the whole produce: metadata waits, routing, a broker that
                # stalls without answering (aiokafka alone would wait its request_timeout_ms)
                async with asyncio.timeout(s.queue_retry_ms / 1000):
                    await produce_entry(self.producer, first, router=self.router, doorbell=self.doorbell,
                                        carry=s.early_start,
                                        deadline_unix_ms=min(first.value.meta.deadline_unix_ms,
                                                             now_ms + s.queue_retry_ms))
            except TOO_LARGE:  # its prompt, stop strings or schema past what one record may carry
                raise Rejected.of(413, "the request is too large to queue (its prompt, stop strings, tools or "
                                       "schema together); shorten it", code="request_too_large") from None
            except (KafkaError, TimeoutError) as exc:  # broker away past queue_retry_ms: a 503, never a 500
                log.warning("could not queue %s on %s: %r", request_id, first.topic, exc)
                self._abort_soon(request_id)  # the record may still reach a broker that comes back
                raise Rejected.of(503, f"the request queue is unavailable right now ({type(exc).__name__}); "
                                       "retry shortly", code="queue_unavailable", retry_after_s=1) from None
            except Exception as exc:  # the gateway's router reads Redis (shared.kv.router, redis_required)
                if not unavailable(exc):
                    raise
                log.warning("could not queue %s: Redis unavailable (%r)", request_id, exc)
                raise Rejected(store_unavailable(exc), STORE_RETRY_AFTER_S) from None
            if chat:  # (admitted: its entry is queued)
                metrics.observe_request_media([m.kind for m in prepared.media])
            try:
                yield Admitted(request_id, model, chat, prepared, key_id, t0)
            except (asyncio.CancelledError, ConnectionResetError):
                await asyncio.shield(self._abort(request_id))
                raise
        finally:
            self.redriver.forget(request_id)
            for lease in leases:  # held until the end: a restart from the source re-reads them
                self.transfer.free_local(lease)
            self.inflight -= 1
            metrics.INFLIGHT.dec()

    def _abort_soon(self, request_id: str) -> None:
        """:meth:`_abort` without waiting for it: the client's answer does not wait on Redis."""
        task = asyncio.create_task(self._abort(request_id), name="abort")
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort(self, request_id: str) -> None:
        """Tell the stages to drop the request (best effort: an unavailable Redis is logged)."""
        try:
            await self.ledger.abort(request_id, ttl_s=self.settings.stream_ttl_s)
        except Exception as exc:
            if not unavailable(exc):
                raise
            log.warning("could not mark %s aborted: Redis unavailable (%r)", request_id, exc)

    async def replies(self, adm: Admitted) -> AsyncIterator[Reply]:
        """Step 5: the request's replies, the last one with ``last`` set (a 504 error reply when
        the request's deadline passes first, a 503 when Redis, where its token stream is, is
        unavailable)."""
        s = self.settings
        deadline_s = asyncio.get_running_loop().time() + s.request_timeout_ms / 1000
        events = _token_timing(self.streams.follow(adm.request_id, deadline_s=deadline_s,
                                                   on_lost=lambda: self.redriver.redrive(adm.request_id)), adm.t0)
        shaper = Shaper(adm.request_id, adm.model, chat=adm.chat,
                        include_usage=adm.prepared.stream and adm.prepared.include_usage,
                        token_text=self.builder.token_text if adm.prepared.sampling.logprobs is not None else None,
                        tool_mode=adm.prepared.tool_mode, tool_max_calls=adm.prepared.tool_max_calls)
        try:
            first = await anext(events)
            async for reply in shape_replies(shaper, first, events, stream=adm.prepared.stream,
                                             include_usage=adm.prepared.include_usage):
                yield reply
        except TimeoutError:
            yield error_reply(protocol.ErrorEvent(
                status=504, type="timeout_error", code="deadline_exceeded",
                message=f"request {adm.request_id} did not finish within {s.request_timeout_ms} ms"))
        except Exception as exc:  # the token stream's read: within redis_timeout_ms past its block
            if not unavailable(exc):
                raise
            log.warning("could not read the token stream of %s: Redis unavailable (%r)", adm.request_id, exc)
            yield error_reply(store_unavailable(exc), STORE_RETRY_AFTER_S)
        finally:
            await events.aclose()

    async def _entry(self, request_id: str, model: str, prepared: Prepared, leases: list[int], scope: str = ""):
        """The request's entry message; its meta records the media sources (see runner
        restarts). Inline media go into the pool; their leases are appended to ``leases`` as
        they are taken, so the caller frees them even when a later item does not fit."""
        now_ms = int(time.time() * 1000)
        items = []
        for m in prepared.media:
            if m.data is None:
                items.append(protocol.MediaSource(kind=m.kind, param=m.param, url=m.url, num_frames=m.num_frames,
                                                  fps=m.fps, min_pixels=m.min_pixels, max_pixels=m.max_pixels,
                                                  uuid=m.uuid))
                continue
            try:
                ref = await self.transfer.put_wait(torch.frombuffer(bytearray(m.data), dtype=torch.uint8),
                                                   timeout_ms=2_000)
            except PoolFullError:
                metrics.ADMISSION_REJECTIONS.labels("media_pool_full").inc()
                raise Rejected.of(429, "server media buffers are full; retry shortly", code="overloaded",
                                  retry_after_s=1) from None
            leases.append(ref.lease)
            items.append(protocol.MediaSource(kind=m.kind, param=m.param, inline=ref, mime=m.mime,
                                              num_frames=m.num_frames, fps=m.fps, grid_thw=m.grid_thw,
                                              second_per_grid_t=m.second_per_grid_t,
                                              min_pixels=m.min_pixels, max_pixels=m.max_pixels, uuid=m.uuid))
        owner = self.transfer.ref() if leases else None
        meta = protocol.RequestMeta(request_id=request_id, model=model, created_unix_ms=now_ms,
                                    deadline_unix_ms=now_ms + self.settings.request_timeout_ms,
                                    prompt_token_ids=tuple(prepared.prompt_token_ids), sampling=prepared.sampling,
                                    sources=tuple(items), source_owner=owner, cache_scope=scope)
        return entry_message(meta)


def too_deep() -> Rejected:
    return Rejected.of(400, f"invalid request body: values nest deeper than {schema.MAX_JSON_DEPTH} levels")


def unknown_field(name: str) -> Rejected:
    return Rejected.of(400, f"unknown parameter {name!r} (this server refuses fields it does not know rather than "
                            "ignore them)", param=name, code="unsupported_parameter")


@contextmanager
def rejections() -> Iterator[None]:
    """A body's decoding and preparation errors as the ``Rejected`` its client gets (400 naming the
    field where the error names one)."""
    try:
        yield
    except msgspec.ValidationError as exc:
        raise Rejected.of(400, f"invalid request body: {exc}", param=schema.error_param(exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise Rejected.of(400, f"invalid request body: {exc}") from None
    except RecursionError:  # nesting past what the JSON decoder itself takes
        raise too_deep() from None
    except RequestFailed as failed:
        raise Rejected(failed.event) from None


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


async def _token_timing(events: AsyncIterator[protocol.StreamEvent], t0: float
                        ) -> AsyncIterator[protocol.StreamEvent]:
    """``events`` unchanged, observing time to first token (from ``t0``, the request's arrival)
    and inter-token latency (a later delta of n tokens counts n gaps of 1/n of its wait)."""
    last = None
    try:
        async for ev in events:
            if isinstance(ev, protocol.TokenDelta) and ev.token_ids:
                now = time.perf_counter()
                if last is None:
                    metrics.TTFT.observe(now - t0)
                else:
                    gap = (now - last) / len(ev.token_ids)
                    for _ in ev.token_ids:
                        metrics.ITL.observe(gap)
                last = now
            yield ev
    finally:
        await events.aclose()
