"""Video decoding under the media policy (PyAV), run on media-fetch's compute lane:
:func:`decode_video_clip` turns raw container bytes into ``uint8 [frames, height, width, 3]`` RGB
frames, and the rate they were sampled at, from the first video stream (MP4/MOV, WebM/Matroska
only), or a ``MediaError``.
Duration and frame side are capped from the header before any frame is decoded,
``max_decoded_frames`` bounds the frames decoded while looking for the sampled ones, and each
kept frame is scaled while converted so frames x pixels stays within ``max_pixels``. Every
exception PyAV raises on untrusted bytes is a ``MediaError``, never a worker fault.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shared.media.sources import MediaError

# PyAV/FFmpeg demuxer names -> what to call them in messages
_ALLOWED_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4/MOV", "matroska,webm": "WebM/Matroska"}
_ACCEPT = "send MP4, MOV, WebM or MKV video"


@dataclass(frozen=True)
class VideoLimits:
    max_duration_s: float
    max_frames: int
    max_side: int
    max_decoded_frames: int
    max_pixels: int = 19_267_584  # all sampled frames together (settings.max_video_pixels' default)


def sample_times(duration_s: float, *, num_frames: int, fps: float, max_frames: int, param: str) -> list[float]:
    """Timestamps (s) to sample: ``fps > 0`` takes one frame every ``1/fps`` seconds (at most
    ``max_frames``; more is a 400 that says how to ask for fewer); otherwise ``num_frames`` evenly
    spaced times over the duration, t_i = (i + 0.5) · duration / n."""
    if fps > 0:
        n = max(1, math.floor(duration_s * fps + 1e-9))
        if n > max_frames:
            raise MediaError(f"{param}: sampling {duration_s:.1f} s of video at {fps:g} fps gives {n} frames, above "
                             f"the limit of {max_frames}; ask for a lower fps or set num_frames")
        return [(i + 0.5) / fps for i in range(n)]
    if not 1 <= num_frames <= max_frames:
        raise MediaError(f"{param}: num_frames must be between 1 and {max_frames}")
    return [(i + 0.5) * duration_s / num_frames for i in range(num_frames)]


class VideoClip(NamedTuple):
    """Sampled frames and the rate they were sampled at (frames per second of the clip's own time:
    Qwen2.5-VL's temporal positions step by it)."""

    frames: np.ndarray
    sampled_fps: float


def sampled_fps(times: list[float], duration_s: float) -> float:
    """Frames per second that :func:`sample_times` took: the reciprocal of their spacing (one frame
    over the whole duration for a single sample)."""
    if len(times) > 1:
        return 1.0 / (times[1] - times[0])
    return 1.0 / duration_s if duration_s > 0 else 1.0


def decode_video(raw: bytes, *, num_frames: int, fps: float, limits: VideoLimits, param: str) -> np.ndarray:
    """:func:`decode_video_clip`'s frames alone."""
    return decode_video_clip(raw, num_frames=num_frames, fps=fps, limits=limits, param=param).frames


def decode_video_clip(raw: bytes, *, num_frames: int, fps: float, limits: VideoLimits, param: str) -> VideoClip:
    """Raw container bytes → RGB frames at :func:`sample_times`, or ``MediaError``. The container
    is decided by PyAV's probe, then checked against the allowlist; anything else (audio-only
    files, images, garbage) is a 400. Caps from the header: ``max_duration_s`` and ``max_side``
    (413). For each sample time the frame on screen at that time is kept (the last frame whose
    timestamp is at or before it; the last frame when the video ends first), so the result is
    deterministic for the same bytes and parameters. Frames larger than ``max_pixels`` / frames
    allow are scaled down, aspect kept (:func:`fit_frame`). Corrupt or truncated streams are a 400."""
    import av

    try:
        container = av.open(io.BytesIO(raw), mode="r", metadata_errors="ignore")
    except Exception as exc:  # noqa: BLE001 - FFmpeg's errors on untrusted bytes come in many types
        raise MediaError(f"{param}: the data is not a readable video container ({_short(exc)}); {_ACCEPT}",
                         code="unsupported_media_type") from None
    try:
        return _decode(container, num_frames=num_frames, fps=fps, limits=limits, param=param)
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt streams surface as av.error.* or ValueError
        raise MediaError(f"{param}: the video is corrupt or truncated ({_short(exc)})") from None
    finally:
        container.close()


def _decode(container, *, num_frames: int, fps: float, limits: VideoLimits, param: str) -> VideoClip:
    fmt = container.format.name
    if fmt not in _ALLOWED_CONTAINERS:
        raise MediaError(f"{param}: the data is a {fmt!r} container, which is not accepted; {_ACCEPT}",
                         code="unsupported_media_type")
    if not container.streams.video:
        raise MediaError(f"{param}: the {_ALLOWED_CONTAINERS[fmt]} file has no video stream; {_ACCEPT}")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise MediaError(f"{param}: the video stream has no frame size (corrupt header)")
    if max(width, height) > limits.max_side:
        raise MediaError(f"{param}: video frames are {width}x{height}, above the limit of {limits.max_side} pixels "
                         "per side; send a smaller video", status=413, code="media_too_large")
    duration_s = _duration_s(container, stream, param)
    if duration_s > limits.max_duration_s:
        raise MediaError(f"{param}: video is {duration_s:.1f} s long, above the limit of {limits.max_duration_s:g} s; "
                         "send a shorter clip", status=413, code="media_too_large")
    times = sample_times(duration_s, num_frames=num_frames, fps=fps, max_frames=limits.max_frames, param=param)
    kept = _Kept(len(times), limits.max_pixels, param)
    shown = None  # the frame on screen before the frame being looked at
    shown_kept = False  # shown is the last frame in kept
    decoded = 0
    for frame in container.decode(stream):
        decoded += 1
        if decoded > limits.max_decoded_frames:
            raise MediaError(f"{param}: video has more than {limits.max_decoded_frames} frames to decode; send a "
                             "shorter clip or a lower frame rate", status=413, code="media_too_large")
        if max(frame.width, frame.height) > limits.max_side:
            raise MediaError(f"{param}: a video frame is {frame.width}x{frame.height}, above the limit of "
                             f"{limits.max_side} pixels per side", status=413, code="media_too_large")
        t = _frame_time_s(frame, stream, decoded)
        while kept.count < len(times) and times[kept.count] < t - 1e-6:
            # the sample time falls before this frame: what was on screen then is the previous one
            if shown is None:
                shown = frame
            kept.add(shown, again=shown_kept)
            shown_kept = True
        if kept.count == len(times):
            break
        if shown is not frame:
            shown, shown_kept = frame, False
    if kept.count < len(times):  # the last frame stays on screen to the end
        if shown is None:
            raise MediaError(f"{param}: the video stream has no decodable frames (corrupt or truncated)")
        while kept.count < len(times):
            kept.add(shown, again=shown_kept)
            shown_kept = True
    return VideoClip(kept.frames, sampled_fps(times, duration_s))


def fit_frame(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) scaled down, aspect kept, so that width x height <= ``max_pixels``
    (unchanged when it fits already); each side at least 1."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    return (max(1, max_pixels // h), h) if w * h > max_pixels else (w, h)


class _Kept:
    """The sampled frames in one ``uint8 [n, h, w, 3]`` array, allocated at the first kept
    frame: its size fitted to ``max_pixels / n`` so the array never holds more than the budget,
    and each frame scaled by swscale as it is converted, so no full-size RGB copy is made."""

    def __init__(self, n: int, max_pixels: int, param: str) -> None:
        self._n, self._frame_pixels, self._param = n, max(1, max_pixels // n), param
        self._source: tuple[int, int] = (0, 0)  # the decoded size every kept frame must have
        self.frames = np.empty((0, 0, 0, 3), np.uint8)
        self.count = 0

    def add(self, frame, *, again: bool = False) -> None:
        """Keep ``frame`` next; ``again``: it is the frame kept last (it stays on screen)."""
        if again:
            self.frames[self.count] = self.frames[self.count - 1]
            self.count += 1
            return
        size = (frame.width, frame.height)
        if self.count == 0:
            self._source = size
            w, h = fit_frame(*size, self._frame_pixels)
            self.frames = np.empty((self._n, h, w, 3), np.uint8)
        elif size != self._source:
            raise MediaError(f"{self._param}: the video changes frame size mid-stream ({self._source[0]}x"
                             f"{self._source[1]} to {size[0]}x{size[1]}); send a video with one frame size")
        h, w = self.frames.shape[1:3]
        scaled = {} if (w, h) == size else {"width": w, "height": h, "interpolation": "AREA"}
        self.frames[self.count] = frame.to_ndarray(format="rgb24", **scaled)
        self.count += 1


def _duration_s(container, stream, param: str = "") -> float:
    """From the stream header, else the container's, else by demuxing packets (no decoding)."""
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / 1_000_000  # av.time_base: microseconds
    end = 0.0
    for packet in container.demux(stream):
        if packet.pts is not None and packet.time_base is not None:
            end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
    container.seek(0)
    if end <= 0:
        raise MediaError(f"{param}: the video has no duration and no timestamps (corrupt or truncated)")
    return end


def _frame_time_s(frame, stream, index: int) -> float:
    if frame.time is not None:
        return float(frame.time)
    rate = float(stream.average_rate or stream.guessed_rate or 25)
    return (index - 1) / rate


def _short(exc: BaseException) -> str:
    # FFmpeg's messages name the (in-memory) file and an errno: neither helps the client
    text = re.sub(r"^\[Errno -?\d+\] |: '<none>'$", "", str(exc))
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
