"""A request's media parts, checked before any I/O: :class:`MediaInput` (one item as the gateway
hands it on), :func:`source` (a part's URL: ``data:`` decoded here with its MIME type and size;
http(s) checked for scheme, host form and non-public IP literals; ``file://`` for syntax when the
operator enabled it; media-fetch re-checks what it loads) and :func:`video_sampling`. Each
refusal is a ``RequestFailed`` naming the part. Design: docs/guide/media.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway import schema
from shared.media.files import file_url_path
from shared.media.sources import (
    MIME_TYPES_BY_KIND,
    REMOTE_SCHEMES,
    MediaError,
    check_remote_url,
    decode_data_url,
    scheme_of,
)
from shared.stage import RequestFailed


@dataclass
class MediaInput:
    kind: str
    param: str
    url: str = ""  # http(s) or file:// (read by media-fetch)
    mime: str = ""
    data: bytes | None = None  # decoded data: URL
    num_frames: int = 0  # video sampling the request asked for (0: server default)
    fps: float = 0.0
    grid_thw: tuple[int, int, int] = (0, 0, 0)  # image / video embeds: the grid they were encoded with
    min_pixels: int = 0  # images: the request's pixel budget (0: the processor's own)
    max_pixels: int = 0
    rows: int = 0  # *_embeds: the embeddings' rows (the tokens the item becomes)
    second_per_grid_t: float = 0.0  # video_embeds (Qwen2.5-VL): the time step they were encoded with
    uuid: str = ""  # the client's name for it (services.gateway.media_names); alone: no data sent


def source(kind: str, url: str, param: str, *, max_bytes: int, allow, files_enabled: bool) -> MediaInput:
    """The item a part's URL names, checked without I/O (see the module docstring); ``max_bytes``:
    the kind's byte cap, ``allow``: the media host allow-list."""
    try:
        scheme = scheme_of(url)
        if not url.strip():
            raise MediaError(f"{param}: {kind} URL is empty")
        if scheme == "data":
            mime, raw = decode_data_url(url, allowed_mime=MIME_TYPES_BY_KIND[kind],
                                        max_bytes=max_bytes, param=param, kind=kind)
            return MediaInput(kind, param, mime=mime, data=raw)
        if scheme == "file":
            try:
                file_url_path(url, enabled=files_enabled)
            except MediaError as exc:
                raise exc.for_param(param) from None
            return MediaInput(kind, param, url=url)
        if scheme not in REMOTE_SCHEMES:
            shown = repr(scheme) if scheme else "(none)"
            raise MediaError(f"{param}: unsupported URL scheme {shown}; use https://, http:// or a data: URL")
        return MediaInput(kind, param, url=check_remote_url(url, param=param, allow_hosts=allow))
    except MediaError as exc:
        raise RequestFailed(exc.status, str(exc), param=param, code=exc.code) from None


def video_sampling(video_url: schema.MediaURL, param: str, max_frames: int) -> tuple[int, float]:
    """(num_frames, fps) the request asked for; 0 means "the server's default"."""
    if video_url.num_frames is not None and video_url.fps is not None:
        raise RequestFailed.bad_request(f"{param}: give video_url.num_frames or video_url.fps, not both",
                                        param=param)
    if video_url.num_frames is not None:
        if not 1 <= video_url.num_frames <= max_frames:
            raise RequestFailed.bad_request(f"{param}: video_url.num_frames must be between 1 and "
                                            f"{max_frames}", param=param)
        return video_url.num_frames, 0.0
    if video_url.fps is not None:
        if not 0.0 < video_url.fps <= 60.0:
            raise RequestFailed.bad_request(f"{param}: video_url.fps must be above 0 and at most 60",
                                            param=param)
        return 0, float(video_url.fps)
    return 0, 0.0
