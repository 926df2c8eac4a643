"""A streaming client that closes its connection mid-stream: ``http_reply`` raises
``ClientGone`` (a ``ConnectionResetError``, which the gateway's admission turns into an abort
upstream) carrying the prepared stream, and aiohttp, handed that stream back, finishes it without
logging a server error."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from aiohttp import web

from services.gateway.responses import ClientGone, Reply, http_reply


@asynccontextmanager
async def _served(app: web.Application):
    """``app`` on a free port, run as the gateway runs it (``services/gateway/main.py``): a
    client's leaving does not cancel its handler. Yields (host, port)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield site._server.sockets[0].getsockname()[:2]
    finally:
        await runner.cleanup()


async def _replies(closed: asyncio.Event):
    try:
        for i in range(10_000):  # far more than the client reads
            yield Reply("chunk", {"i": i})
            await asyncio.sleep(0.005)
    finally:
        closed.set()


async def test_a_client_that_leaves_mid_stream_is_no_server_error(caplog) -> None:
    gone: list[ClientGone] = []
    closed = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:  # as the gateway's _serve and _admit do
        replies = _replies(closed)
        try:
            return await http_reply(request, replies, stream=True)
        except ClientGone as exc:
            gone.append(exc)
            return exc.response
        finally:
            await replies.aclose()

    app = web.Application()
    app.router.add_get("/", handler)
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with _served(app) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        await writer.drain()
        while b"data: " not in await reader.readline():  # the headers, then the first SSE event
            pass
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(closed.wait(), 30)  # the stream's replies were closed: its handler ended
    assert len(gone) == 1 and isinstance(gone[0], ConnectionResetError)
    assert gone[0].response.prepared
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_stream_read_to_the_end_ends_with_done() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        async def replies():
            for i in range(3):
                yield Reply("chunk", {"i": i})
        return await http_reply(request, replies(), stream=True)

    app = web.Application()
    app.router.add_get("/", handler)
    async with _served(app) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        await writer.drain()
        body = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert body.count(b"data: {") == 3 and b"data: [DONE]" in body
