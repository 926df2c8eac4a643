"""A real headless Chromium for tests, driven over its DevTools protocol (a websocket, with
aiohttp's client): navigate, evaluate JavaScript in the page, take screenshots.

Chromium comes from Debian's ``chromium`` package (``make test`` installs it when it runs as root
with apt); :func:`chromium_binary` is None without it, and tests skip saying so. The browser
runs with a throw-away profile and is killed and reaped by :func:`chromium`, whatever happens.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

_LISTENING = re.compile(rb"DevTools listening on (ws://[^\s]+)")


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Page:
    """One tab's DevTools session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, timeout_s: float = 30, **params):
        msg_id = next(self._ids)
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        async with asyncio.timeout(timeout_s):
            while True:
                reply = await self._ws.receive_json()
                if reply.get("id") == msg_id:  # events (no id) are not asked for, and skipped
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})

    async def goto(self, url: str, timeout_s: float = 30) -> None:
        """Navigate, and return once the new document has loaded."""
        await self.call("Page.navigate", url=url)
        await self.wait_for(f"location.href === {url!r} && document.readyState === 'complete'", timeout_s)

    async def js(self, expression: str):
        """The expression's value (JSON-able), awaiting it when it is a promise."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, interval_s: float = 0.25):
        """Poll ``expression`` until it is truthy; its value, or TimeoutError naming it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.js(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise TimeoutError(f"not true within {timeout_s} s: {expression}")
            await asyncio.sleep(interval_s)

    async def screenshot(self, path: Path) -> None:
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))


@asynccontextmanager
async def chromium(*, width: int = 1400, height: int = 900, start_timeout_s: float = 60):
    """A headless Chromium with one blank tab; yields its :class:`Page`."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("no chromium binary")
    profile = tempfile.mkdtemp(prefix="mmfleet-chromium-")
    argv = [binary, "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
            "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                start_new_session=True)
    drain = None
    try:
        async with asyncio.timeout(start_timeout_s):
            while not (match := _LISTENING.search(line := await proc.stderr.readline())):
                if not line:
                    raise RuntimeError("chromium exited before it listened")
        # keep reading its stderr so a chatty browser never blocks on a full pipe
        drain = asyncio.create_task(_drain(proc.stderr))
        port = int(match.group(1).decode().split(":")[2].split("/")[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(page_ws, max_msg_size=64 * 1024 * 1024) as ws:
                yield Page(ws)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the browser's helper processes too
        await proc.wait()
        if drain is not None:
            drain.cancel()
        shutil.rmtree(profile, ignore_errors=True)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass
