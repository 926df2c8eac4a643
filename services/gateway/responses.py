"""OpenAI response shapes (bodies, SSE chunks, errors) built from stream events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

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


def usage_dict(usage: protocol.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class Shaper:
    """Builds the JSON of one request's responses: chat (``chat.completion``) or text
    (``text_completion``) objects, whole or as stream chunks."""

    def __init__(self, request_id: str, model: str, *, chat: bool) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str | None, finish_reason: str | None, *, first: bool = False) -> bytes:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def usage_chunk(self, usage: protocol.Usage) -> bytes:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_dict(usage)
        return b"data: " + orjson.dumps(body) + b"\n\n"

    @staticmethod
    def error_chunk(ev: protocol.ErrorEvent) -> bytes:
        return b"data: " + orjson.dumps(error_body(ev.status, ev.message, type_=ev.type, param=ev.param,
                                                   code=ev.code)) + b"\n\n"

    def whole(self, text: str, finish: protocol.Finish) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish.reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_dict(finish.usage)
        return body


async def whole_response(shaper: Shaper, first: protocol.StreamEvent,
                         events: AsyncIterator[protocol.StreamEvent]) -> web.Response:
    """Collect a request's events (``first``, then ``events``) into one JSON body."""
    texts: list[str] = []
    ev = first
    while True:
        match ev:
            case protocol.TokenDelta(text=text):
                texts.append(text)
            case protocol.Finish():
                return web.Response(body=orjson.dumps(shaper.whole("".join(texts), ev)),
                                    content_type="application/json")
            case protocol.ErrorEvent():
                return event_error_response(ev)
        ev = await anext(events)


async def sse_response(request: web.Request, shaper: Shaper, first: protocol.StreamEvent,
                       events: AsyncIterator[protocol.StreamEvent], include_usage: bool) -> web.StreamResponse:
    """Forward a request's events as OpenAI SSE chunks, ending with ``data: [DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(shaper.chunk("", None, first=True))
    ev = first
    while True:
        match ev:
            case protocol.TokenDelta(text=text):
                if text:
                    await resp.write(shaper.chunk(text, None))
            case protocol.Finish(reason=reason, usage=usage):
                await resp.write(shaper.chunk(None, reason))
                if include_usage:
                    await resp.write(shaper.usage_chunk(usage))
                break
            case protocol.ErrorEvent():
                await resp.write(Shaper.error_chunk(ev))
                break
        ev = await anext(events)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
