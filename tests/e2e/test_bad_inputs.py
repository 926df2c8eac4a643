"""A corpus of bad inputs against a running fleet (``mmfleet up``: real broker, Redis, NIXL,
four workers and the gateway). Every case gets its documented 4xx with an OpenAI error body
whose message says what to fix; afterwards the same worker processes are still running and a
normal request is served. The media-fetch worker's peak RSS over the corpus is printed.

Network: only 127.0.0.1. The allowlist names the local media server's exact port
(``127.0.0.1:<port>``), so every other loopback port stays refused; DNS names are
``localhost`` and the loopback names of /etc/hosts (no public DNS).
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests import procs
from tests.media import samples
from tests.media.server import MediaServer

MiB = 1024 * 1024
MAX_REQUEST_BYTES = 8 * MiB
MAX_IMAGE_BYTES = 2 * MiB
MAX_VIDEO_BYTES = 2 * MiB
MAX_VIDEO_DURATION_S = 5
MAX_VIDEO_SIDE = 512
MAX_VIDEO_DECODED_FRAMES = 150
BODY_TIMEOUT_MS = 2_000
P0 = "messages[0].content[0]"
MP4 = samples.video(samples.video_frames(12, size=(64, 48)), fps=6)  # 2 s, a good video
FILES = {
    "/ok.mp4": MP4,
    "/corrupt.mp4": MP4[: len(MP4) // 2],
    "/long.mp4": samples.video(samples.video_frames(14, size=(32, 32)), fps=2),  # 7 s
    "/ok.png": samples.png((64, 48), seed=1),
    "/corrupt.png": samples.truncated(samples.png((64, 64), seed=2)),
    "/bomb.png": samples.png_claiming(100_000, 100_000),
    "/text.png": b"this is not an image",
    "/page.html": samples.html_page(),
    "/gif.gif": samples.gif(),
    "/polyglot-zip.png": samples.png_then_zip(),
}
RESULTS: list[tuple[str, int, str]] = []


# ---------------------------------------------------------------------------- fixtures
@dataclass
class Fleet:
    base: str
    supervisor: int
    children: list[int]
    media_fetch: int
    media: MediaServer
    root: Path
    redis_port: int
    hwm_start_kib: int = 0
    ctx: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def media_server():
    with MediaServer(FILES).in_thread() as srv:
        yield srv


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("media-files")
    root = base / "root"
    (root / "sub").mkdir(parents=True)
    (root / "ok.png").write_bytes(FILES["/ok.png"])
    (root / "big.png").write_bytes(samples.png_claiming(10, 10) + b"\x00" * (MAX_IMAGE_BYTES + 10))
    (base / "secret.png").write_bytes(FILES["/ok.png"])
    (root / "escape.png").symlink_to(base / "secret.png")
    (root / "escape-dir").symlink_to(base)
    (root / "inside.png").symlink_to(root / "ok.png")
    (root / "ok.mp4").write_bytes(MP4)
    (base / "secret.mp4").write_bytes(MP4)
    (root / "escape.mp4").symlink_to(base / "secret.mp4")
    os.mkfifo(root / "fifo.png")
    return root


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, redis_url, model_dir, logs_dir, media_server, media_root):
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url, "MMFLEET_MODEL_PATH": str(model_dir),
           "MMFLEET_POOL_BYTES": str(64 * MiB),
           "MMFLEET_MEDIA_ALLOW_HOSTS": f"127.0.0.1:{media_server.port}",
           "MMFLEET_MEDIA_FILE_ROOT": str(media_root),
           "MMFLEET_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES), "MMFLEET_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES),
           "MMFLEET_MEDIA_FETCH_TIMEOUT_MS": "3000", "MMFLEET_MEDIA_READ_TIMEOUT_MS": "1000",
           "MMFLEET_MEDIA_MAX_REDIRECTS": "3", "MMFLEET_MAX_VIDEO_BYTES": str(MAX_VIDEO_BYTES),
           "MMFLEET_MAX_VIDEO_DURATION_S": str(MAX_VIDEO_DURATION_S), "MMFLEET_MAX_VIDEO_SIDE": str(MAX_VIDEO_SIDE),
           "MMFLEET_MAX_VIDEO_DECODED_FRAMES": str(MAX_VIDEO_DECODED_FRAMES),
           "MMFLEET_REQUEST_BODY_TIMEOUT_MS": str(BODY_TIMEOUT_MS)}
    with procs.fleet(env, logs_dir) as (base, proc):
        kids = sorted(procs.children_of(proc.pid))
        mf = [k for k in kids if "media-fetch" in _cmdline(k)]
        assert len(mf) == 1, [(k, _cmdline(k)) for k in kids]
        f = Fleet(base, proc.pid, kids, mf[0], media_server, media_root, int(redis_url.rsplit(":", 1)[1].split("/")[0]))
        f.hwm_start_kib = _vm_hwm_kib(f.media_fetch)
        yield f


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\x00", b" ").decode()
    except OSError:
        return ""


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def post(base: str, body: bytes, path: str = "/v1/chat/completions", timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, json.loads(raw) if raw else {}


def chat(*parts, role: str = "user", stream: bool = False) -> bytes:
    return json.dumps({"model": "mmfleet-demo", "max_tokens": 4, "temperature": 0, "stream": stream,
                       "messages": [{"role": role, "content": [*parts, {"type": "text", "text": "What is this?"}]}]
                       }).encode()


def img(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def vid(url: str, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def vpart(url: str, **extra):
    """A case body: one video part whose URL may name {media} {root}."""
    return lambda f: chat(vid(url.format(**f.ctx), **extra))


def _embeds(arr, fmt: str = "npy") -> dict:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return {"type": "image_embeds", "image_embeds": {"data": b64(buf.getvalue()), "format": fmt,
                                                     "grid_thw": [1, 4, 4]}}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _loopback_names() -> list[str]:
    """Names /etc/hosts maps to loopback (besides localhost): DNS names with no DNS server."""
    names: list[str] = []
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        return names
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0] in ("127.0.0.1", "127.0.1.1", "::1"):
            names += [n for n in fields[1:] if "localhost" not in n and n not in names]
    return names[:2]


# ---------------------------------------------------------------------------- the corpus
@dataclass(frozen=True)
class Case:
    id: str
    status: int
    fragment: str  # must appear in error.message
    body: object  # bytes, or a callable(Fleet) -> bytes
    param: str | None = P0  # the message must start with it (None: gateway-level errors)


def part(url: str, **extra):
    """A case body: one image part whose URL may name {media} {gw} {redis} {root} {other}."""
    return lambda f: chat(img(url.format(**f.ctx), **extra))


def stream_part(url: str):
    return lambda f: chat(img(url.format(**f.ctx)), stream=True)


def redirect(to: str):
    return lambda f: chat(img(f"http://127.0.0.1:{f.media.port}/redirect?to=" + to.format(**f.ctx)))


PNG = samples.png((32, 24))
CASES = [
    # --- request bodies and parts the gateway refuses
    Case("body: not JSON", 400, "invalid request body", b"{not json", None),
    Case("body: empty", 400, "invalid request body", b"", None),
    Case("body: JSON array", 400, "invalid request body", b"[]", None),
    Case("body: invalid UTF-8", 400, "invalid request body", b'{"model": "\xff\xfe"}', None),
    Case("body: messages missing", 400, "messages", b'{"model": "mmfleet-demo"}', None),
    Case("body: messages not a list", 400, "$.messages", b'{"model": "mmfleet-demo", "messages": 5}', None),
    Case("part: content is a number", 400, "$.messages[0].content",
         json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": 7}]}).encode(), None),
    Case("part: unknown type", 400, "$.messages[0].content[0]", chat({"type": "image", "url": "x"}), None),
    Case("part: no type", 400, "$.messages[0].content[0]", chat({"image_url": {"url": "x"}}), None),
    Case("part: image_url is a string", 400, "$.messages[0].content[0].image_url",
         chat({"type": "image_url", "image_url": "https://example.com/a.png"}), None),
    Case("part: image_url without url", 400, "url", chat({"type": "image_url", "image_url": {}}), None),
    Case("part: url is a number", 400, "$.messages[0].content[0].image_url.url",
         chat({"type": "image_url", "image_url": {"url": 5}}), None),
    Case("part: bad detail", 400, "image_url.detail: must be auto, low or high",
         part("https://example.com/a.png", detail="max"), f"{P0}.image_url.detail"),
    Case("part: image in a system message", 400, "user messages only",
         chat(img("https://example.com/a.png"), role="system")),
    # --- modalities the served model (Qwen2-VL: text, image, video) does not take
    Case("modality: input_audio", 400, "model 'mmfleet-demo' does not accept audio input",
         chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})),
    Case("modality: audio_url", 400, "does not accept audio input (audio_url parts); it accepts text, image, video",
         chat({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}})),
    Case("modality: silent WAV as input_audio", 400, "does not accept audio input",
         chat({"type": "input_audio", "input_audio": {"data": b64(samples.wav(freq=0.0)), "format": "wav"}})),
    Case("modality: garbage input_audio", 400, "does not accept audio input",
         chat({"type": "input_audio", "input_audio": {"data": b64(b"\x00garbage" * 50), "format": "mp3"}})),
    Case("url: empty", 400, "URL is empty", part("")),
    Case("url: no scheme", 400, "unsupported URL scheme (none)", part("example.com/cat.png")),
    Case("url: ftp", 400, "unsupported URL scheme 'ftp'", part("ftp://example.com/cat.png")),
    Case("url: host that crashes the URL parser", 400, "malformed URL", part("http://[]@/a.png")),
    Case("url: javascript", 400, "unsupported URL scheme 'javascript'", part("javascript:alert(1)")),
    Case("url: gopher to redis", 400, "unsupported URL scheme 'gopher'", part("gopher://127.0.0.1:{redis}/_INFO")),
    # --- data: URLs
    Case("data: bad base64", 400, "invalid base64 in data URL: character '!'", part("data:image/png;base64,!!!x")),
    Case("data: whitespace in base64", 400, "character ' '", part("data:image/png;base64,iVBO Rw0K")),
    Case("data: url-safe base64", 400, "character '-'", part("data:image/png;base64,iVBO-_0K")),
    Case("data: bad padding", 400, "multiple of 4", part("data:image/png;base64,iVBORw0")),
    Case("data: not base64-encoded", 400, "must be base64-encoded", part("data:image/png,rawbytes")),
    Case("data: no comma", 400, "malformed data URL", part("data:image/png;base64")),
    Case("data: text/plain", 400, "does not match an image_url part", part("data:text/plain;base64,aGVsbG8=")),
    Case("data: application/pdf", 400, "does not match an image_url part",
         part("data:application/pdf;base64,JVBERi0=")),
    Case("data: image/gif", 400, "image type 'image/gif' is not accepted", part("data:image/gif;base64,R0lGODlh")),
    Case("data: image/svg+xml", 400, "image type 'image/svg+xml' is not accepted",
         part("data:image/svg+xml;base64,PHN2Zz4=")),
    Case("data: no MIME type", 400, "no valid MIME type", part("data:;base64,iVBORw0K")),
    Case("data: empty payload", 400, "data URL is empty", part("data:image/png;base64,")),
    Case("data: over the image byte cap", 413, f"{MAX_IMAGE_BYTES} byte limit",
         chat(img(samples.data_url(b"\x89PNG" + b"\x00" * (3 * MiB))))),
    # --- inline bytes that are not an acceptable image (decoded in media-fetch)
    Case("image: plain text", 400, "not a recognised image", chat(img(samples.data_url(b"hello, plain text")))),
    Case("image: truncated PNG", 400, "PNG image", chat(img(samples.data_url(samples.truncated(PNG, 0.5))))),
    Case("image: truncated JPEG", 400, "JPEG", chat(img(samples.data_url(samples.truncated(samples.jpeg(), 0.05),
                                                                          "image/jpeg")))),
    Case("image: PNG with a bad CRC", 400, "PNG", chat(img(samples.data_url(samples.png_bad_crc())))),
    Case("image: GIF labelled PNG", 400, "GIF images are not accepted", chat(img(samples.data_url(samples.gif())))),
    Case("image: BMP labelled PNG", 400, "is BMP, which is not accepted", chat(img(samples.data_url(samples.bmp())))),
    Case("image: TIFF labelled JPEG", 400, "is TIFF, which", chat(img(samples.data_url(samples.tiff(), "image/jpeg")))),
    Case("image: SVG labelled PNG", 400, "is SVG, which",
         chat(img(samples.data_url(samples.svg_image())))),
    Case("image: PDF labelled PNG", 400, "is PDF, which", chat(img(samples.data_url(b"%PDF-1.7\n%...")))),
    Case("polyglot: HTML behind a PNG signature", 400, "not a readable PNG image",
         chat(img(samples.data_url(samples.html_with_png_magic())))),
    Case("polyglot: ZIP containing a PNG", 400, "is ZIP, which", chat(img(samples.data_url(samples.zip_then_png())))),
    Case("bomb: PNG header 100000x100000", 413, "pixels",
         chat(img(samples.data_url(samples.png_claiming(100_000, 100_000))))),
    Case("bomb: PNG header 8000x8000", 413, "8000x8000 pixels, above the limit",
         chat(img(samples.data_url(samples.png_claiming(8000, 8000))))),
    Case("image: aspect ratio the model refuses", 400, "cannot be processed by this model",
         chat(img(samples.data_url(samples.png((1000, 1)))))),
    # --- sizes and counts
    Case("body: over max_request_bytes", 413, "request body is larger than",
         b'{"model": "mmfleet-demo", "messages": [{"role": "user", "content": "' + b"a" * (MAX_REQUEST_BYTES + MiB)
         + b'"}]}', None),
    Case("too many media items", 413, "media items; the limit is 8",
         chat(*[img("https://example.com/a.png")] * 9), None),
    # --- SSRF: IP literals (refused by the gateway before any I/O)
    Case("ssrf: the gateway itself", 400, "127.0.0.1 is a loopback address", part("http://127.0.0.1:{gw}/v1/models")),
    Case("ssrf: redis", 400, "loopback address", part("http://127.0.0.1:{redis}/")),
    Case("ssrf: another port of the allowlisted host", 400, "loopback address", part("http://127.0.0.1:{other}/x")),
    Case("ssrf: cloud metadata", 400, "link-local (cloud metadata) address",
         part("http://169.254.169.254/latest/meta-data/iam/security-credentials/")),
    Case("ssrf: [::1]", 400, "::1 is a loopback address", part("http://[::1]:{gw}/v1/models")),
    Case("ssrf: IPv4-mapped IPv6", 400, "IPv4-mapped loopback", part("http://[::ffff:127.0.0.1]:{media}/ok.png")),
    Case("ssrf: 10/8", 400, "private address", part("http://10.0.0.1/a.png")),
    Case("ssrf: 172.16/12", 400, "private address", part("http://172.16.0.1/a.png")),
    Case("ssrf: 192.168/16", 400, "private address", part("http://192.168.1.1/a.png")),
    Case("ssrf: 0.0.0.0", 400, "unspecified address", part("http://0.0.0.0:{gw}/v1/models")),
    Case("ssrf: fe80::/10", 400, "link-local address", part("http://[fe80::1]/a.png")),
    Case("ssrf: fc00::/7", 400, "private address", part("http://[fd00::1]/a.png")),
    Case("ssrf: multicast", 400, "multicast address", part("http://224.0.0.1/a.png")),
    Case("ssrf: decimal IP", 400, "non-standard form", part("http://2130706433:{media}/ok.png")),
    Case("ssrf: octal IP", 400, "non-standard form", part("http://0177.0.0.1:{media}/ok.png")),
    Case("ssrf: hex IP", 400, "non-standard form", part("http://0x7f.1:{media}/ok.png")),
    Case("ssrf: hex dword IP", 400, "non-standard form", part("http://0x7f000001:{media}/ok.png")),
    Case("ssrf: short IP", 400, "non-standard form", part("http://127.1:{media}/ok.png")),
    Case("ssrf: percent-encoded host", 400, "may not contain '%'", part("http://%31%32%37.0.0.1:{media}/ok.png")),
    Case("ssrf: fullwidth digits", 400, "127.0.0.1 is a loopback address", part("http://１２７.０.０.１:{gw}/")),
    Case("ssrf: credentials", 400, "user name or password", part("http://user:pw@127.0.0.1:{media}/ok.png")),
    # --- SSRF: names (refused by media-fetch's resolver)
    Case("ssrf: localhost", 400, "resolves to 127.0.0.1, a loopback address", part("http://localhost:{media}/ok.png")),
    Case("ssrf: LOCALHOST.", 400, "host localhost.", part("http://LOCALHOST.:{media}/ok.png")),
    *[Case(f"ssrf: /etc/hosts name {n}", 400, "a loopback address", part(f"http://{n}:{{media}}/ok.png"))
      for n in _loopback_names()],
    # --- SSRF through redirects from the allowlisted media server
    Case("redirect: to the gateway", 400, "redirected to http://127.0.0.1",
         redirect("http://127.0.0.1:{gw}/v1/models")),
    Case("redirect: to cloud metadata", 400, "link-local (cloud metadata)",
         redirect("http://169.254.169.254/latest/meta-data/")),
    Case("redirect: to localhost", 400, "resolves to 127.0.0.1", redirect("http://localhost:{media}/ok.png")),
    Case("redirect: to [::1]", 400, "loopback", redirect("http://[::1]:{media}/ok.png")),
    Case("redirect: to a decimal IP", 400, "non-standard form", redirect("http://2130706433:{media}/ok.png")),
    Case("redirect: to file://", 400, "unsupported URL scheme 'file'", redirect("file:///etc/passwd")),
    Case("redirect: loop", 400, "too many redirects (more than 3)",
         lambda f: chat(img(f"http://127.0.0.1:{f.media.port}/loop"))),
    # --- misbehaving media server
    Case("remote: endless body", 413, f"larger than the {MAX_IMAGE_BYTES} byte limit",
         part("http://127.0.0.1:{media}/endless")),
    Case("remote: Content-Length 10^12", 413, "above the", part("http://127.0.0.1:{media}/cl-huge")),
    Case("remote: body shorter than Content-Length", 400, "cut short", part("http://127.0.0.1:{media}/cl-long")),
    Case("remote: HTTP 404", 400, "returned HTTP 404", part("http://127.0.0.1:{media}/missing.png")),
    Case("remote: headers too slow", 400, "timed out", part("http://127.0.0.1:{media}/slow-headers?s=5")),
    Case("remote: gzip body", 400, "not a recognised image", part("http://127.0.0.1:{media}/gzip")),
    Case("remote: corrupt PNG", 400, "corrupt or truncated", part("http://127.0.0.1:{media}/corrupt.png")),
    Case("remote: pixel bomb", 413, "pixels", part("http://127.0.0.1:{media}/bomb.png")),
    Case("remote: text", 400, "not a recognised image", part("http://127.0.0.1:{media}/text.png")),
    Case("remote: HTML page", 400, "is HTML, which", part("http://127.0.0.1:{media}/page.html")),
    Case("remote: GIF", 400, "GIF images are not accepted", part("http://127.0.0.1:{media}/gif.gif")),
    # --- file://
    Case("file: /etc/passwd", 400, "outside the directory", part("file:///etc/passwd")),
    Case("file: .. segments", 400, "'..' segments", part("file://{root}/../secret.png")),
    Case("file: encoded .. segments", 400, "'..' segments", part("file://{root}/%2e%2e/secret.png")),
    Case("file: symlink escape", 400, "outside the directory", part("file://{root}/escape.png")),
    Case("file: directory symlink escape", 400, "outside the directory", part("file://{root}/escape-dir/secret.png")),
    Case("file: missing", 400, "does not exist", part("file://{root}/missing.png")),
    Case("file: a directory", 400, "does not name a regular file", part("file://{root}/sub")),
    Case("file: a FIFO", 400, "does not name a regular file", part("file://{root}/fifo.png")),
    Case("file: other host", 400, "is not allowed; use file:///absolute/path", part("file://example.com{root}/ok.png")),
    Case("file: over the byte cap", 413, f"above the {MAX_IMAGE_BYTES} byte limit", part("file://{root}/big.png")),
    # --- video
    Case("video: over the byte cap (data:)", 413, f"{MAX_VIDEO_BYTES} byte limit",
         chat(vid(samples.data_url(b"\x00" * (3 * MiB), "video/mp4")))),
    Case("video: longer than the duration cap", 413, f"7.0 s long, above the limit of {MAX_VIDEO_DURATION_S} s",
         vpart("http://127.0.0.1:{media}/long.mp4")),
    Case("video: frames wider than the side cap", 413, f"640x32, above the limit of {MAX_VIDEO_SIDE} pixels",
         chat(vid(samples.data_url(samples.video(samples.video_frames(2, size=(640, 32))), "video/mp4")))),
    Case("video: too many frames to decode", 413, f"more than {MAX_VIDEO_DECODED_FRAMES} frames to decode",
         chat(vid(samples.data_url(samples.video(samples.video_frames(240, size=(16, 16)), fps=60), "video/mp4")))),
    Case("video: corrupt container", 400, "not a readable video container",
         chat(vid(samples.data_url(b"\x00\x00\x00\x18ftypmp42" + b"\x13" * 400, "video/mp4")))),
    Case("video: truncated mp4 (remote)", 400, "video", vpart("http://127.0.0.1:{media}/corrupt.mp4")),
    Case("video: garbage labelled webm", 400, "not a readable video container",
         chat(vid(samples.data_url(b"not a video at all" * 20, "video/webm")))),
    Case("video: PNG labelled mp4", 400, "container, which is not accepted",
         chat(vid(samples.data_url(PNG, "video/mp4")))),
    Case("video: WAV labelled mp4", 400, "container, which is not accepted",
         chat(vid(samples.data_url(samples.wav(), "video/mp4")))),
    Case("video: image MIME in a video part", 400, "does not match a video_url part",
         chat(vid(samples.data_url(PNG)))),
    Case("video: video/avi", 400, "video type 'video/avi' is not accepted",
         chat(vid(samples.data_url(b"RIFF....AVI ", "video/avi")))),
    Case("video: empty data URL", 400, "data URL is empty", vpart("data:video/mp4;base64,")),
    Case("video: num_frames 0", 400, "num_frames must be between 1 and 32", vpart("https://example.com/v.mp4",
                                                                                 num_frames=0)),
    Case("video: num_frames 1000", 400, "num_frames must be between 1 and 32", vpart("https://example.com/v.mp4",
                                                                                    num_frames=1000)),
    Case("video: num_frames and fps", 400, "not both", vpart("https://example.com/v.mp4", num_frames=2, fps=1.0)),
    Case("video: fps 0", 400, "fps must be above 0", vpart("https://example.com/v.mp4", fps=0)),
    Case("video: fps giving too many frames", 400, "above the limit of 32; ask for a lower fps",
         vpart("http://127.0.0.1:{media}/ok.mp4", fps=30)),
    Case("video: num_frames is a string", 400, "$.messages[0].content[0].video_url.num_frames",
         chat(vid("https://example.com/v.mp4", num_frames="all")), None),
    Case("video: in a system message", 400, "user messages only",
         chat(vid("https://example.com/v.mp4"), role="system")),
    Case("video: remote 404", 400, "returned HTTP 404", vpart("http://127.0.0.1:{media}/missing.mp4")),
    Case("video: ssrf to the gateway", 400, "loopback address", vpart("http://127.0.0.1:{gw}/v1/models")),
    Case("video: file symlink escape", 400, "outside the directory", vpart("file://{root}/escape.mp4")),
    # --- precomputed embeddings
    Case("embeds: wrong hidden size", 400, "its hidden size is 128", chat(_embeds(np.zeros((4, 64), np.float32)))),
    Case("embeds: pickled object array", 400, "without pickle", chat(_embeds(np.array([{"x": 1}], dtype=object)))),
    Case("embeds: rows do not fit grid_thw", 400, "needs 4", chat(_embeds(np.zeros((5, 128), np.float32)))),
    Case("embeds: torch.save format", 400, "format must be one of npy, safetensors",
         chat(_embeds(np.zeros((4, 128), np.float32), fmt="pt"))),
    # --- streaming requests get the same status before any SSE
    Case("stream: bad image", 400, "not a recognised image", stream_part("data:image/png;base64," + b64(b"nope"))),
    Case("stream: ssrf by name", 400, "resolves to 127.0.0.1", stream_part("http://localhost:{gw}/v1/models")),
    Case("stream: corrupt video", 400, "not a readable video container",
         lambda f: chat(vid(samples.data_url(b"garbage" * 30, "video/mp4")), stream=True)),
]


def test_corpus_is_large_enough():
    assert len(CASES) >= 50
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(fleet, case):
    fleet.ctx.update(media=fleet.media.port, gw=fleet.base.rsplit(":", 1)[1], redis=fleet.redis_port,
                     root=fleet.root, other=fleet.media.port + 1 if fleet.media.port < 65535 else 1)
    body = case.body(fleet) if callable(case.body) else case.body
    status, resp = post(fleet.base, body)
    err = resp.get("error") or {}
    RESULTS.append((case.id, status, err.get("message", "")))
    assert status == case.status, (status, resp)
    assert set(err) >= {"message", "type", "param", "code"}, resp
    assert err["type"] == "invalid_request_error"
    assert case.fragment in err["message"], err["message"]
    if case.param is not None:
        assert err["message"].startswith(case.param), err["message"]
        assert err["param"] == case.param


def test_polyglot_png_then_zip_is_served_as_its_png(fleet):
    status, resp = post(fleet.base, chat(img(f"http://127.0.0.1:{fleet.media.port}/polyglot-zip.png")))
    assert status == 200, resp
    status2, resp2 = post(fleet.base, chat(img(samples.data_url(samples.png(seed=3)))))
    assert status2 == 200 and resp["choices"][0]["message"] == resp2["choices"][0]["message"]


def test_allowed_sources_are_served(fleet):
    for url in (f"http://127.0.0.1:{fleet.media.port}/ok.png", f"file://{fleet.root}/ok.png",
                f"file://{fleet.root}/inside.png", samples.data_url(FILES["/ok.png"]),
                f"http://127.0.0.1:{fleet.media.port}/redirect?to=/ok.png"):
        status, resp = post(fleet.base, chat(img(url)))
        assert status == 200, (url, resp)
        assert resp["choices"][0]["message"]["content"] is not None
    for url in (f"http://127.0.0.1:{fleet.media.port}/ok.mp4", f"file://{fleet.root}/ok.mp4",
                samples.data_url(MP4, "video/mp4")):
        status, resp = post(fleet.base, chat(vid(url, num_frames=4)))
        assert status == 200, (url, resp)
        assert resp["choices"][0]["message"]["content"] is not None


def test_an_abandoned_upload_is_no_server_error(fleet, logs_dir):
    """A client that leaves mid-body is not an error of the server: no traceback in the log."""
    host, port = fleet.base.removeprefix("http://").rsplit(":", 1)
    log = logs_dir / "gateway.log"
    before = log.read_text(errors="replace") if log.exists() else ""
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b'{"model": "mmfleet-demo", "messages": [')
            time.sleep(0.2)
    time.sleep(1.0)
    assert post(fleet.base, chat())[0] == 200  # and the gateway serves on
    added = log.read_text(errors="replace")[len(before):]
    assert "Traceback" not in added and "Error handling request" not in added, added[-2000:]


def _deep_schema(levels: int) -> dict:
    """A JSON Schema whose compact JSON doubles with each level (5.5 MB at 16): its grammar takes
    seconds to build, so it must be refused by its size before any is built."""
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node, "b": node}, "required": ["a"]}
    return node


COSTLY = {  # name: (body, what its 400 names); each within MAX_REQUEST_BYTES, each seconds of gateway CPU
    # (and, before the bounds ran first, as long with the event loop held) had it been decoded,
    # rendered, tokenized or built into a grammar
    "200k messages": (json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": ""}] * 200_000}),
                      "request_too_complex"),
    "50k messages": (json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user"}] * 50_000}), "messages"),
    "1.5M stop strings": (json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": "hi"}],
                                      "stop": ["a"] * 1_500_000}), "request_too_complex"),
    "7 MB prompt": (json.dumps({"model": "mmfleet-demo", "prompt": "hello world " * 580_000}), "prompt"),
    "5.5 MB schema": (json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": _deep_schema(16)}}}),
                      "request_too_complex"),
    "350 kB schema": (json.dumps({"model": "mmfleet-demo", "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": _deep_schema(12)}}}),
                      "response_format.json_schema.schema"),
}


def test_health_answers_while_costly_requests_are_refused(fleet, capsys):
    """Costly bodies are refused by their bounds (400 naming the field, or the body's size in
    JSON values) off the gateway's event loop: /health keeps answering meanwhile (the bound here
    is generous against a loaded CI machine; before, such requests held the loop for seconds)."""
    import threading

    worst: list[float] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(fleet.base + "/health", timeout=30) as resp:
                assert resp.status == 200
            worst.append(time.perf_counter() - t0)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answers = {}
        for _round in range(3):
            for name, (body, _) in COSTLY.items():
                path = "/v1/completions" if "prompt" in name else "/v1/chat/completions"
                status, resp = post(fleet.base, body.encode(), path=path)
                answers[name] = (status, resp.get("error", {}).get("param") or resp.get("error", {}).get("code"))
    finally:
        done.set()
        watcher.join()
    assert answers == {name: (400, named) for name, (_, named) in COSTLY.items()}
    with capsys.disabled():
        print(f"\n/health while costly requests were refused: {len(worst)} answers, slowest "
              f"{max(worst) * 1000:.1f} ms")
    assert max(worst) < 0.5


def test_a_body_that_stops_arriving_is_a_408_and_frees_its_slot(fleet):
    """An admitted request holds an in-flight slot while its body arrives: a sender that stalls
    gets a 408 once ``request_body_timeout_ms`` passes, not a slot held for as long as it likes."""
    host, port = fleet.base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"model": "mmfleet-demo", "messages": [')
        t0 = time.perf_counter()
        head = sock.recv(4096)
        waited_s = time.perf_counter() - t0
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"request_timeout" in head
    assert BODY_TIMEOUT_MS / 1000 - 0.5 < waited_s < 20  # the bound, not a speed
    assert post(fleet.base, chat())[0] == 200


def test_fleet_survived_the_corpus(fleet, capsys):
    """Runs last in this module: the same processes, a normal request served, peak RSS reported."""
    assert sorted(procs.children_of(fleet.supervisor)) == fleet.children
    assert all(procs.alive(p) for p in fleet.children)
    status, resp = post(fleet.base, chat(img(samples.data_url(samples.png((80, 64), seed=5)))))
    assert status == 200 and resp["object"] == "chat.completion", resp
    status, resp = post(fleet.base, chat(img(f"http://127.0.0.1:{fleet.media.port}/ok.png")))
    assert status == 200, resp
    hwm = _vm_hwm_kib(fleet.media_fetch)
    with capsys.disabled():
        print(f"\nmedia-fetch worker pid {fleet.media_fetch}: VmHWM {hwm / 1024:.1f} MiB after the corpus "
              f"({fleet.hwm_start_kib / 1024:.1f} MiB when the fleet became ready); {len(RESULTS)} cases ran")
        for case_id, status, message in RESULTS:
            print(f"  {status}  {case_id:45s} {message[:110]}")
    assert hwm < 2 * 1024 * 1024  # KiB: a generous bound, not a tight budget
