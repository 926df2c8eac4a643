"""OpenAI response shapes (bodies, stream chunks, errors) built from stream events.

:func:`shape_replies` is the one place that turns a request's token-stream events into what
the client receives, as a sequence of :class:`Reply` JSON bodies; the HTTP handler writes them
as one body or as SSE ``data:`` lines, the Kafka ingress as one record each.

Design: docs/guide/api.md.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web

from services.gateway import tools
from shared import protocol

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error", 504: "timeout_error"}


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(status, message, type_=type_, param=param,
                                                                   code=code)),
                        content_type="application/json", headers=headers)


def event_error_response(ev: protocol.ErrorEvent) -> web.Response:
    return error_response(ev.status, ev.message, type_=ev.type, param=ev.param, code=ev.code)


def event_error_body(ev: protocol.ErrorEvent) -> dict:
    return error_body(ev.status, ev.message, type_=ev.type, param=ev.param, code=ev.code)


class Rejected(Exception):
    """A request refused before it entered the fleet (auth, bad body, admission, queue down).
    ``retry_after_s``: set when retrying later can succeed (429, 503)."""

    def __init__(self, event: protocol.ErrorEvent, retry_after_s: int | None = None) -> None:
        super().__init__(event.message)
        self.event = event
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, status: int, message: str, *, param: str | None = None, code: str | None = None,
           retry_after_s: int | None = None) -> Rejected:
        ev = protocol.ErrorEvent(status=status, type=_ERROR_TYPES.get(status, "server_error"), message=message,
                                 param=param, code=code)
        return cls(ev, retry_after_s)

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        ev = self.event
        return error_response(ev.status, ev.message, type_=ev.type, param=ev.param, code=ev.code, headers=headers)


STORE_RETRY_AFTER_S = 1


def store_unavailable(exc: BaseException) -> protocol.ErrorEvent:
    """The 503 for a Redis that stalled or went away (``shared.transport.redis_conn.unavailable``):
    the request's claims and token stream live there. Sent with ``STORE_RETRY_AFTER_S``."""
    return protocol.ErrorEvent(status=503, type="server_error", code="store_unavailable",
                               message=f"the request state store is unavailable right now ({type(exc).__name__}); "
                                       "retry shortly")


def usage_dict(usage: protocol.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


@dataclass(frozen=True)
class Reply:
    """One JSON body for the client. ``kind``: "completion" (a whole answer), "chunk" (one
    stream chunk) or "error" (an OpenAI error body; ``status`` its HTTP status). ``last``: the
    request's terminal reply. ``retry_after_s``: an error's ``Retry-After``."""

    kind: str
    body: dict
    status: int = 200
    last: bool = False
    retry_after_s: int | None = None


def error_reply(ev: protocol.ErrorEvent, retry_after_s: int | None = None) -> Reply:
    return Reply("error", event_error_body(ev), ev.status, last=True, retry_after_s=retry_after_s)


class Shaper:
    """Builds the JSON of one request's responses: chat (``chat.completion``) or text
    (``text_completion``) objects, whole or as stream chunks."""

    def __init__(self, request_id: str, model: str, *, chat: bool, include_usage: bool = False,
                 token_text: Callable[[int], str] | None = None, tool_mode: str = "",
                 tool_max_calls: int = 0) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.include_usage = include_usage  # stream chunks then carry "usage": null until the last
        self.token_text = token_text  # set: the request asked for logprobs (token id -> its text)
        self._offset = 0  # completions' text_offset of the next token
        self.tool_mode = tool_mode  # "" | "auto" | "forced": see services.gateway.tools
        self.tool_max_calls = tool_max_calls  # 0: any number (parallel_tool_calls false: 1)

    def logprobs(self, lps: Sequence[protocol.TokenLogprob]) -> dict | None:
        """OpenAI's ``logprobs`` object of a choice (chat: ``content``; completions: parallel
        lists) for ``lps``; None when the request did not ask for logprobs."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                t = text(tid)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                    for x in lps], "refusal": None}
        tokens = [text(x.token_id) for x in lps]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{text(t): v for t, v in (*x.top, (x.token_id, x.logprob))} for x in lps],
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, obj: str, choices: list[dict]) -> dict:
        body = self._envelope(obj, choices)
        if self.include_usage:  # as OpenAI: every chunk has the key, null but in the usage chunk
            body["usage"] = None
        return body

    def chunk_body(self, text: str | None, finish_reason: str | None, *, first: bool = False,
                   logprobs: Sequence[protocol.TokenLogprob] = ()) -> dict:
        lp = self.logprobs(logprobs) if logprobs else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text or lp else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return self._chunk("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        return self._chunk("text_completion", [choice])

    def usage_body(self, usage: protocol.Usage) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_dict(usage)
        return body

    def tool_calls_chunk(self, calls: list[dict]) -> dict:
        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return self._chunk("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}])

    def whole(self, text: str, finish: protocol.Finish, logprobs: Sequence[protocol.TokenLogprob] = ()) -> dict:
        lp = self.logprobs(logprobs)
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            reason = finish.reason
            if self.tool_mode:
                message["content"], calls = tools.parse(text, self.tool_mode, self.tool_max_calls)
                if calls:
                    message["tool_calls"], reason = calls, "tool_calls"
                else:
                    message["content"] = text
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_dict(finish.usage)
        return body


async def shape_replies(shaper: Shaper, first: protocol.StreamEvent, events: AsyncIterator[protocol.StreamEvent],
                        *, stream: bool, include_usage: bool) -> AsyncIterator[Reply]:
    """A request's replies from its events (``first``, then ``events``), ending with one whose
    ``last`` is set. An error before any token is a single error reply; with ``stream``, a
    role chunk, one chunk per non-empty delta, the finish chunk and, with ``include_usage``,
    a usage chunk (or an error reply where the stream failed)."""
    if isinstance(first, protocol.ErrorEvent):
        yield error_reply(first)
        return
    if stream:
        yield Reply("chunk", shaper.chunk_body("", None, first=True))
    texts: list[str] = []
    lps: list[protocol.TokenLogprob] = []
    calls_out = tools.ToolStream(shaper.tool_mode, shaper.tool_max_calls) if stream and shaper.tool_mode else None
    ev = first
    while True:
        match ev:
            case protocol.TokenDelta(text=text, logprobs=delta_lps):
                if not stream:
                    texts.append(text)
                    lps.extend(delta_lps)
                elif calls_out is not None:
                    if shown := calls_out.feed(text):
                        yield Reply("chunk", shaper.chunk_body(shown, None))
                elif text or (delta_lps and shaper.token_text is not None):
                    yield Reply("chunk", shaper.chunk_body(text, None, logprobs=delta_lps))
            case protocol.Finish(reason=reason, usage=usage):
                if not stream:
                    yield Reply("completion", shaper.whole("".join(texts), ev, lps), last=True)
                    return
                if calls_out is not None:
                    rest, calls = calls_out.finish()
                    if rest:
                        yield Reply("chunk", shaper.chunk_body(rest, None))
                    if calls:
                        yield Reply("chunk", shaper.tool_calls_chunk(calls))
                        reason = "tool_calls"
                yield Reply("chunk", shaper.chunk_body(None, reason), last=not include_usage)
                if include_usage:
                    yield Reply("chunk", shaper.usage_body(usage), last=True)
                return
            case protocol.ErrorEvent():
                yield error_reply(ev)
                return
        ev = await anext(events)


def sse_line(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ClientGone(ConnectionResetError):
    """The client closed its connection while its stream was being written. A
    ``ConnectionResetError``, so the admission aborts the request upstream; ``response`` is the
    prepared stream, for the handler to hand back to aiohttp, which finishes it quietly (a client
    that leaves is not a server error: no traceback in the log)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client closed the connection")
        self.response = response


async def http_reply(request: web.Request, replies: AsyncIterator[Reply], *, stream: bool) -> web.StreamResponse:
    """Write a request's replies as HTTP: the first reply decides the status (an error before
    any token is a proper HTTP error, even with ``stream``); a stream is SSE ending with
    ``data: [DONE]``, where a later error travels as an SSE error object. A client that closes
    its connection mid-stream raises :class:`ClientGone`."""
    first = await anext(replies)
    if first.kind == "error":
        headers = {"Retry-After": str(first.retry_after_s)} if first.retry_after_s else None
        return web.Response(status=first.status, body=orjson.dumps(first.body), content_type="application/json",
                            headers=headers)
    if not stream:
        return web.Response(body=orjson.dumps(first.body), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        await resp.write(sse_line(first.body))
        async for reply in replies:
            await resp.write(sse_line(reply.body))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError as exc:
        raise ClientGone(resp) from exc
    return resp


async def whole_response(shaper: Shaper, first: protocol.StreamEvent,
                         events: AsyncIterator[protocol.StreamEvent]) -> web.Response:
    """Collect a request's events (``first``, then ``events``) into one JSON body."""
    reply = await anext(shape_replies(shaper, first, events, stream=False, include_usage=False))
    return web.Response(status=reply.status, body=orjson.dumps(reply.body), content_type="application/json")


async def sse_response(request: web.Request, shaper: Shaper, first: protocol.StreamEvent,
                       events: AsyncIterator[protocol.StreamEvent], include_usage: bool) -> web.StreamResponse:
    """Forward a request's events as OpenAI SSE chunks, ending with ``data: [DONE]``."""
    return await http_reply(request, shape_replies(shaper, first, events, stream=True, include_usage=include_usage),
                            stream=True)
