"""Where media comes from: parsing and checking ``data:`` URLs and classifying and checking
``http(s)://`` URLs (the address policy lives in :mod:`shared.media.netguard`, ``file://`` in
:mod:`shared.media.files`). Every check raises ``MediaError`` with a message that tells the user
what to fix; stages turn it into a 400/413 for the request (never a worker crash). These
functions are pure and safe on arbitrary input: anything but ``MediaError`` escaping them is a
bug (a property test holds them to that).

Design: docs/guide/media.md.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterable

import pybase64
import yarl

from shared.media.netguard import AllowList, a_reason, parse_ip, refusal_reason

IMAGE_MIME_TYPES = frozenset({"image/jpeg", "image/png", "image/webp"})
# What each media kind accepts in a data: URL, and which request part carries it. A new kind
# (video, audio) adds its line here and a decoder in media-fetch.
VIDEO_MIME_TYPES = frozenset({"video/mp4", "video/webm", "video/quicktime", "video/x-matroska"})
AUDIO_MIME_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/mpeg", "audio/flac", "audio/ogg",
                              "audio/webm", "audio/mp4"})
MIME_TYPES_BY_KIND: dict[str, frozenset[str]] = {"image": IMAGE_MIME_TYPES, "video": VIDEO_MIME_TYPES,
                                                 "audio": AUDIO_MIME_TYPES}
PART_BY_KIND = {"image": "image_url", "video": "video_url", "audio": "audio_url"}
_MIME_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}  # common in the wild

MAX_URL_CHARS = 8192  # http(s)/file URLs; data: URLs are bounded by the media byte cap
REMOTE_SCHEMES = ("http", "https")

_MIME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")
_NON_B64 = re.compile(r"[^A-Za-z0-9+/=]")
_HOSTNAME = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?)*\.?", re.I)
# WHATWG: a host whose last label is a number is an IPv4 address (decimal, octal or hex parts)
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)", re.I)


class MediaError(ValueError):
    """Bad media in a request. ``status``: the HTTP status the client should see."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_media") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def for_param(self, param: str) -> MediaError:
        """The same error, its message prefixed with the request's JSON path (once)."""
        text = str(self)
        if not param or text.startswith(param):
            return self
        return MediaError(f"{param}: {text}", status=self.status, code=self.code)


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-cased ('' when there is none)."""
    head, sep, _ = url[:64].partition(":")
    return head.strip().lower() if sep and head.strip().isascii() else ""


# ---------------------------------------------------------------------------- data: URLs
def decode_data_url(url: str, *, allowed_mime: frozenset[str], max_bytes: int, param: str,
                    kind: str = "image") -> tuple[str, bytes]:
    """``data:<mime>[;params];base64,<payload>`` → (mime, raw bytes).

    The MIME type must be one ``kind`` accepts (``image/*`` for an ``image_url`` part); the
    size is checked on the encoded length before decoding (base64 is 4/3 of the raw size), so
    an oversized payload is refused without allocating its decoded copy.
    """
    if scheme_of(url) != "data":
        raise MediaError(f"{param}: malformed data URL; expected data:<mime type>;base64,<data>")
    header, sep, payload = url.partition(":")[2].partition(",")
    if not sep or len(header) > 256:
        raise MediaError(f"{param}: malformed data URL; expected data:<mime type>;base64,<data>")
    fields = [f.strip() for f in header.split(";")]
    mime = _MIME_ALIASES.get(fields[0].lower(), fields[0].lower())
    accepted = ", ".join(sorted(allowed_mime))
    part = PART_BY_KIND.get(kind, kind)
    if not _MIME.fullmatch(mime):
        raise MediaError(f"{param}: data URL has no valid MIME type ({fields[0][:40]!r}); use one of {accepted}",
                         code="unsupported_media_type")
    if mime not in allowed_mime:
        if not mime.startswith(kind + "/"):
            article = "an" if part[:1] in "aeiou" else "a"
            raise MediaError(f"{param}: data URL has MIME type {mime!r}, which does not match {article} {part} part; "
                             f"use one of {accepted}", code="unsupported_media_type")
        raise MediaError(f"{param}: {kind} type {mime!r} is not accepted; use one of {accepted}",
                         code="unsupported_media_type")
    if len(fields) < 2 or fields[-1].lower() != "base64":
        raise MediaError(f"{param}: data URL must be base64-encoded (data:{mime};base64,...)")
    if len(payload) > 4 * ((max_bytes + 2) // 3):
        raise MediaError(f"{param}: media is larger than the {max_bytes} byte limit", status=413,
                         code="media_too_large")
    if not payload:
        raise MediaError(f"{param}: data URL is empty")
    try:  # one strict pass; the payload is scanned for what is wrong only when it fails
        raw = strict_b64decode(payload)
    except (binascii.Error, ValueError):
        bad = _NON_B64.search(payload)
        if bad:
            raise MediaError(f"{param}: invalid base64 in data URL: character {bad.group()!r} at offset "
                             f"{bad.start()}; use standard base64 (A-Z a-z 0-9 + /, '=' padding) without "
                             "whitespace") from None
        raise MediaError(f"{param}: invalid base64 in data URL ({_b64_reason(payload)}); the length must be a "
                         "multiple of 4, padded with '='") from None
    if not raw:
        raise MediaError(f"{param}: data URL is empty")
    if len(raw) > max_bytes:
        raise MediaError(f"{param}: media is {len(raw)} bytes, above the {max_bytes} byte limit", status=413,
                         code="media_too_large")
    return mime, raw


def strict_b64decode(text: str) -> bytes:
    """Standard base64 (RFC 4648: no whitespace, '=' only as the last group's padding) to bytes;
    ``binascii.Error`` or ``ValueError`` otherwise. pybase64's SIMD decoder accepts what
    ``binascii.a2b_base64(strict_mode=True)`` does, less '=' after a complete group (which binascii
    lets through; ``tests/media/test_sources.py``), at ~40x its speed: a 600 KB image's payload
    in 0.1 ms instead of 4, a GIL-holding call on the gateway's preparation threads."""
    return pybase64.b64decode(text, validate=True)


def _b64_reason(text: str) -> str:
    """Why ``text`` is not strict base64, in binascii's words ("Incorrect padding", ...)."""
    try:
        binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        return str(exc)
    return "'=' after a complete group"


# ---------------------------------------------------------------------------- http(s) URLs
def as_allowlist(allow: AllowList | Iterable[str] | None) -> AllowList:
    return allow if isinstance(allow, AllowList) else AllowList(allow or ())


def parse_remote_url(url: str, allow: AllowList) -> yarl.URL:
    """Check an ``http(s)`` URL before any I/O; returns the parsed URL to fetch (the very
    object handed to aiohttp, so the host checked is the host connected). ``MediaError``
    without a param prefix.

    Refused: other schemes, no host, credentials, malformed hosts, IPv4 in non-canonical
    numeric forms, and IP literals that are not public (unless allowlisted). Names are checked
    when they are resolved (``fetch.GuardedResolver``).
    """
    if len(url) > MAX_URL_CHARS:
        raise MediaError(f"URL is {len(url)} characters long; the limit is {MAX_URL_CHARS}")
    try:
        u = yarl.URL(url)
        host, port = u.raw_host, u.port
    except Exception as exc:  # noqa: BLE001 - untrusted input into a third-party parser: ValueError mostly,
        # but yarl 1.25 raises IndexError for "http://[]@/" (found by the property test)
        detail = str(exc)[:120] if isinstance(exc, ValueError) else "it cannot be parsed"
        raise MediaError(f"malformed URL ({detail})") from None
    if u.scheme not in REMOTE_SCHEMES:
        raise MediaError(f"unsupported URL scheme {u.scheme!r}; use https://, http:// or a data: URL")
    if not host:
        raise MediaError("URL has no host")
    if u.raw_user is not None or u.raw_password is not None:
        raise MediaError("URL may not contain a user name or password (user:password@host)")
    check_host(host, port, allow)
    return u


def check_host(host: str, port: int | None, allow: AllowList) -> None:
    """The host of a URL, as written: a well-formed name, or an IP literal the policy allows."""
    if "%" in host:
        raise MediaError(f"URL host {host!r} may not contain '%' (percent-encoding or an IPv6 zone)",
                         code="media_url_forbidden")
    ip = parse_ip(host)
    if ip is None:
        if len(host) > 253 or not _HOSTNAME.fullmatch(host):
            raise MediaError(f"URL host {host[:80]!r} is not a valid host name")
        if _NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
            raise MediaError(f"URL host {host} is a numeric address in a non-standard form; write IPv4 addresses "
                             "as four decimal numbers (a.b.c.d)", code="media_url_forbidden")
        return
    if allow.allows(host, port):
        return
    reason = refusal_reason(ip)
    if reason:
        raise MediaError(f"URL host {host} is {a_reason(reason)} address; media URLs must point at public addresses "
                         "(the operator can allowlist trusted hosts with media_allow_hosts)",
                         code="media_url_forbidden")


def check_remote_url(url: str, *, param: str, allow_hosts: AllowList | Iterable[str] | None = None) -> str:
    """Accept ``http(s)://host/...`` (see ``parse_remote_url``); returns the URL."""
    try:
        parse_remote_url(url, as_allowlist(allow_hosts))
    except MediaError as exc:
        raise exc.for_param(param) from None
    return url
