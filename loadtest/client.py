"""An OpenAI SSE client that times every chunk (the ``openai`` package hides when each arrived).

Per request (:class:`RequestRecord`), ms from just before the POST: ``ttft_ms`` (the first chunk
with non-empty ``delta.content``), ``itl_ms`` (gaps between such chunks), ``e2e_ms`` (``[DONE]``
or EOF), ``tpot_ms`` = (e2e − ttft) / (output_tokens − 1) (None under 2 tokens);
``output_tokens`` / ``prompt_tokens`` from the usage chunk, else the content-chunk count
(``usage_reported`` False); ``status`` (0: no response; an error object in a 200 stream keeps
the status and sets ``error``); ``ok`` = 200 and no error. Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import orjson


@dataclass
class RequestRecord:
    index: int
    start_s: float = 0.0  # when it was sent, seconds after the run started
    sent_unix_ms: float = 0.0  # wall clock at the POST (the fleet's spans are in wall clock too)
    status: int = 0
    error: str | None = None
    request_id: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (prefix cache hits)
    usage_reported: bool = False
    n_chunks: int = 0
    n_images: int = 0
    finish_reason: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


async def send(session: aiohttp.ClientSession, url: str, body: dict, *, index: int = 0, run_t0: float = 0.0,
               timeout_s: float = 120.0) -> RequestRecord:
    """POST one streamed chat completion and time it; never raises for request failures."""
    rec = RequestRecord(index=index)
    payload = orjson.dumps(body)
    rec.sent_unix_ms = time.time() * 1000
    t0 = time.perf_counter()
    rec.start_s = t0 - run_t0 if run_t0 else 0.0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = _error_message(await resp.read()) or resp.reason
                    rec.e2e_ms = (time.perf_counter() - t0) * 1000
                    return rec
                await _consume(resp, rec, t0)
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:.0f} s"
    except aiohttp.ClientError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    if rec.e2e_ms is None:
        rec.e2e_ms = (time.perf_counter() - t0) * 1000
    return rec


async def _consume(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
    last_content: float | None = None
    texts: list[str] = []
    async for raw in resp.content:  # one SSE line at a time, as the bytes arrive
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event: lines
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            rec.error = f"bad SSE data: {data[:80]!r}"
            break
        rec.n_chunks += 1
        if "error" in chunk:
            err = chunk["error"]
            rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            break
        rec.request_id = rec.request_id or chunk.get("id")
        usage = chunk.get("usage")
        if usage:
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            rec.usage_reported = True
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") or choice.get("text")
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
            if content:
                texts.append(content)
                if last_content is None:
                    rec.ttft_ms = (now - t0) * 1000
                else:
                    rec.itl_ms.append((now - last_content) * 1000)
                last_content = now
    end = time.perf_counter()
    rec.e2e_ms = (end - t0) * 1000
    rec.text = "".join(texts)
    if not rec.usage_reported:
        rec.output_tokens = len(rec.itl_ms) + (1 if rec.ttft_ms is not None else 0)
    if rec.ttft_ms is not None and rec.output_tokens > 1:
        rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)


def _error_message(body: bytes) -> str | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace") or None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return err.get("message")
    return str(err or obj)[:200]
