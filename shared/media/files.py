"""``file://`` media: off unless the operator names a root directory (``media_file_root``); then
only regular files under that root, after resolving symlinks. Refused: a host other than none or
``localhost``, relative paths, ``..`` segments, NUL bytes, paths that resolve outside the root,
anything that is not a regular file, and files above the byte cap. The file is opened without
following a final symlink and its real path checked again from the open descriptor, so swapping
a path component for a symlink between check and open does not escape the root. Messages never
reveal the root or whether a path outside it exists.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import unquote, urlsplit

from shared.media.sources import MAX_URL_CHARS, MediaError

_DISABLED = "file:// URLs are not enabled on this server; use https://, http:// or a data: URL"


def file_url_path(url: str, *, enabled: bool) -> str:
    """Syntax checks of a ``file://`` URL (what the gateway can check): its absolute path."""
    if not enabled:
        raise MediaError(_DISABLED)
    if len(url) > MAX_URL_CHARS:
        raise MediaError(f"URL is {len(url)} characters long; the limit is {MAX_URL_CHARS}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise MediaError(f"malformed file URL ({exc})") from None
    if parts.scheme.lower() != "file":
        raise MediaError("expected a file:// URL")
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file URL host {parts.netloc[:80]!r} is not allowed; use file:///absolute/path")
    try:
        path = unquote(parts.path, errors="strict")
    except UnicodeDecodeError:
        raise MediaError("file URL path is not valid UTF-8 after percent-decoding") from None
    if "\x00" in path:
        raise MediaError("file URL path may not contain NUL bytes")
    if not path.startswith("/"):
        raise MediaError("file URL must name an absolute path (file:///absolute/path)")
    if ".." in path.split("/"):
        raise MediaError("file URL path may not contain '..' segments", code="media_url_forbidden")
    return path


def load_file(url: str, *, root: str, max_bytes: int) -> bytes:
    """The bytes of a ``file://`` URL under ``root`` (blocking: run it in a thread)."""
    path = file_url_path(url, enabled=bool(root))
    root_real = os.path.realpath(root)
    real = os.path.realpath(path)
    if not _inside(real, root_real):
        raise MediaError("file URL points outside the directory this server serves media from",
                         code="media_url_forbidden")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise MediaError("file URL names a file that does not exist") from None
    except OSError as exc:  # ELOOP (a symlink swapped in), EACCES, ...
        raise MediaError(f"file URL cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError("file URL does not name a regular file")
        opened = os.path.realpath(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else real
        if not _inside(opened, root_real):
            raise MediaError("file URL points outside the directory this server serves media from",
                             code="media_url_forbidden")
        if st.st_size > max_bytes:
            raise MediaError(f"media is {st.st_size} bytes, above the {max_bytes} byte limit", status=413,
                             code="media_too_large")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # the file grew since fstat
                raise MediaError(f"media is larger than the {max_bytes} byte limit", status=413,
                                 code="media_too_large")
    finally:
        os.close(fd)
    if not total:
        raise MediaError("file URL names an empty file")
    return b"".join(chunks)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
