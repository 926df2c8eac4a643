"""Where media comes from: parsing and checking ``data:`` URLs and classifying URLs.

Every check raises ``MediaError`` with a message that tells the user what to fix; stages turn
it into a 400 for the request (never a worker crash).
"""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import urlsplit

IMAGE_MIME_TYPES = frozenset({"image/jpeg", "image/png", "image/webp"})

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


class MediaError(ValueError):
    """Bad media in a request. ``status``: the HTTP status the client should see."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_media") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def decode_data_url(url: str, *, allowed_mime: frozenset[str], max_bytes: int, param: str) -> tuple[str, bytes]:
    """``data:<mime>;base64,<payload>`` → (mime, raw bytes).

    The size is checked on the encoded length before decoding (base64 is 4/3 of the raw size),
    so an oversized payload is refused without allocating its decoded copy.
    """
    m = _DATA_URL.match(url)
    if not m:
        raise MediaError(f"{param}: malformed data URL; expected data:<mime type>;base64,<data>")
    mime = (m.group("mime") or "").lower()
    if mime not in allowed_mime:
        raise MediaError(
            f"{param}: unsupported MIME type {mime or '(none)'!r}; use one of {', '.join(sorted(allowed_mime))}",
            code="unsupported_media_type",
        )
    if not m.group("b64"):
        raise MediaError(f"{param}: data URL must be base64-encoded (data:{mime};base64,...)")
    payload = url[m.end():]
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise MediaError(f"{param}: media is larger than the {max_bytes} byte limit", status=413, code="media_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{param}: invalid base64 in data URL ({exc})") from None
    if not raw:
        raise MediaError(f"{param}: data URL is empty")
    return mime, raw


def check_remote_url(url: str, *, param: str) -> str:
    """Accept ``http(s)://host/...`` only; returns the URL. Address checks happen at fetch time."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise MediaError(f"{param}: unsupported URL scheme {parts.scheme!r}; use https://, http:// or a data: URL")
    if not parts.hostname:
        raise MediaError(f"{param}: URL has no host")
    return url
