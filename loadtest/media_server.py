"""A local media server: ``GET /img/<seed>-<w>x<h>.<png|jpg>`` → that deterministic image.

Optional latency injection: each response waits ``N(mean_ms, std_ms)`` (clipped at 0), drawn
from a seeded generator, to stand in for a remote image host. ``GET /health`` answers 200.
:class:`ThreadedMediaServer` runs it in this process on a thread of its own (tests);
:class:`MediaServerProcess` in a subprocess (``python -m loadtest media-server``), which the
harness uses so serving images never competes with the client's timing for the GIL.

Design: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
from pathlib import Path

from aiohttp import web

from loadtest import procs
from loadtest.images import image_bytes, parse_name

HITS = web.AppKey("hits", dict)


def create_app(*, latency_mean_ms: float = 0.0, latency_std_ms: float = 0.0, seed: int = 0) -> web.Application:
    rng = random.Random(seed)
    app = web.Application()
    app[HITS] = {}

    async def serve(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            ref = parse_name(name)
        except ValueError as exc:
            return web.Response(status=404, text=str(exc))
        if latency_mean_ms > 0 or latency_std_ms > 0:
            await asyncio.sleep(max(0.0, rng.gauss(latency_mean_ms, latency_std_ms)) / 1000)
        app[HITS][name] = app[HITS].get(name, 0) + 1
        # rendering a new image takes milliseconds of CPU: off the loop, so one slow render
        # does not delay responses already waiting
        body = await asyncio.to_thread(image_bytes, ref)
        return web.Response(body=body, content_type=ref.mime)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "served": sum(app[HITS].values())})

    app.router.add_get("/img/{name}", serve)
    app.router.add_get("/health", health)
    return app


class ThreadedMediaServer:
    """``with ThreadedMediaServer() as srv: srv.base_url`` — serves until the block ends."""

    def __init__(self, *, latency_mean_ms: float = 0.0, latency_std_ms: float = 0.0, seed: int = 0,
                 port: int = 0) -> None:
        self.app = create_app(latency_mean_ms=latency_mean_ms, latency_std_ms=latency_std_ms, seed=seed)
        self.port = port or procs.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.app, access_log=None)
        self._thread: threading.Thread | None = None

    @property
    def hits(self) -> dict[str, int]:
        return dict(self.app[HITS])

    def __enter__(self) -> ThreadedMediaServer:
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._thread = threading.Thread(target=self._loop.run_forever, name="media-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._thread = None
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()


class MediaServerProcess:
    """The same server as a child process of the harness (stopped and reaped on exit)."""

    def __init__(self, log_dir: Path, *, latency_mean_ms: float = 0.0, latency_std_ms: float = 0.0,
                 seed: int = 0) -> None:
        self.port = procs.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._argv = [sys.executable, "-m", "loadtest", "media-server", "--port", str(self.port),
                      "--latency-mean-ms", str(latency_mean_ms), "--latency-std-ms", str(latency_std_ms),
                      "--seed", str(seed)]
        self._log = log_dir / "media-server.log"
        self._proc = None

    def __enter__(self) -> MediaServerProcess:
        self._proc = procs.spawn(self._argv, log_path=self._log, cwd=procs.REPO)
        try:
            procs.wait_http(self.base_url + "/health", self._proc, 30, self._log)
        except BaseException:
            procs.stop_group(self._proc)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            procs.stop_group(self._proc, timeout_s=5)
            self._proc = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--latency-mean-ms", type=float, default=0.0, help="injected latency per image, mean")
    p.add_argument("--latency-std-ms", type=float, default=0.0, help="injected latency per image, stddev")
    p.add_argument("--seed", type=int, default=0, help="seed of the latency draws")


def serve_main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (``python -m loadtest media-server``)."""
    app = create_app(latency_mean_ms=args.latency_mean_ms, latency_std_ms=args.latency_std_ms, seed=args.seed)
    print(f"media server on http://{args.host}:{args.port}/img/<seed>-<w>x<h>.png", flush=True)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
    return 0
