"""A raw HTTP/1.1 server on 127.0.0.1 for media-fetch tests: serves images and misbehaves on
purpose (endless bodies, lying Content-Length, redirects, slow or trickling responses,
compressed bodies). Raw sockets rather than aiohttp.web so a response can break HTTP rules.

Every request is recorded (path, Host header); every accepted connection is counted, so a test
can assert that a refused fetch never connected.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit


class MediaServer:
    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.requests: list[tuple[str, str]] = []  # (path, Host header)
        self.connections = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()  # connections being served (stop() ends them)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hits(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)

    async def start(self) -> MediaServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # on 3.11 wait_closed() does not wait for handlers: one still trickling or endless would be
        # torn down by the garbage collector after its loop closed (an unraisable RuntimeError)
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    @contextmanager
    def in_thread(self):
        """Run on its own event loop in a daemon thread (for synchronous tests)."""
        loop = asyncio.new_event_loop()
        loop.run_until_complete(self.start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        self._handlers.add(handler)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            url = urlsplit(target)
            self.requests.append((url.path, headers.get("host", "")))
            await self._respond(url.path, parse_qs(url.query), writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            self._handlers.discard(handler)
            try:
                writer.close()
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def _respond(self, path: str, query: dict[str, list[str]], w: asyncio.StreamWriter) -> None:
        def head(status: str, headers: dict[str, str]) -> bytes:
            lines = [f"HTTP/1.1 {status}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
            return ("\r\n".join(lines) + "\r\n\r\n").encode()

        if path in self.files:
            body = self.files[path]
            w.write(head("200 OK", {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}))
            w.write(body)
        elif path == "/redirect":  # /redirect?to=<url>[&status=301]
            status = query.get("status", ["302"])[0]
            w.write(head(f"{status} Found", {"Location": query["to"][0], "Content-Length": "0"}))
        elif path == "/loop":
            w.write(head("302 Found", {"Location": "/loop", "Content-Length": "0"}))
        elif path == "/slow-loop":  # a redirect loop that takes 300 ms per hop
            await asyncio.sleep(0.3)
            w.write(head("302 Found", {"Location": "/slow-loop", "Content-Length": "0"}))
        elif path == "/endless":  # chunked, never ends
            w.write(head("200 OK", {"Transfer-Encoding": "chunked"}))
            chunk = b"\xff" * 65536
            while True:
                w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await w.drain()
        elif path == "/endless-nolength":  # no length, no chunking: the body ends when the socket does
            w.write(head("200 OK", {}))
            while True:
                w.write(b"\x00" * 65536)
                await w.drain()
        elif path == "/cl-huge":  # announces far more than any cap
            w.write(head("200 OK", {"Content-Length": str(10**12)}))
            w.write(b"\x00" * 1024)
        elif path == "/cl-short":  # announces 100 bytes, sends 5000
            w.write(head("200 OK", {"Content-Length": "100"}))
            w.write(b"A" * 5000)
        elif path == "/cl-long":  # announces 5000 bytes, sends 100 and closes
            w.write(head("200 OK", {"Content-Length": "5000"}))
            w.write(b"B" * 100)
        elif path == "/slow-headers":
            await asyncio.sleep(float(query.get("s", ["3"])[0]))
            w.write(head("200 OK", {"Content-Length": "1"}) + b"x")
        elif path == "/trickle":  # one byte every 100 ms, forever
            w.write(head("200 OK", {"Transfer-Encoding": "chunked"}))
            while True:
                w.write(b"1\r\nz\r\n")
                await w.drain()
                await asyncio.sleep(0.1)
        elif path == "/gzip":  # a compressed body; the fetcher must not expand it
            body = gzip.compress(b"\x00" * 5_000_000)
            w.write(head("200 OK", {"Content-Encoding": "gzip", "Content-Length": str(len(body))}))
            w.write(body)
        elif path == "/empty":
            w.write(head("200 OK", {"Content-Length": "0"}))
        elif path == "/redirect-nolocation":
            w.write(head("302 Found", {"Content-Length": "0"}))
        else:
            w.write(head("404 Not Found", {"Content-Length": "0"}))
        await w.drain()
