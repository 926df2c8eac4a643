"""Video decoding under the media policy (PyAV): sampling by num_frames or fps, the caps on
duration, side and decoded frames, the frames x pixels budget frames are scaled into while
decoding, container allowlist, and every bad input a MediaError (a 4xx), never a crash. Videos
are encoded in the test from numpy frames."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from shared.media.sources import MediaError
from shared.media.video import VideoLimits, decode_video, fit_frame, sample_times
from tests.media import samples

LIMITS = VideoLimits(max_duration_s=60, max_frames=16, max_side=256, max_decoded_frames=2_000)


def graded(n: int, size=(64, 48)) -> np.ndarray:
    """Frame i is a solid grey of level 10 * i + 20: its index can be read back after lossy coding."""
    w, h = size
    return np.stack([np.full((h, w, 3), (10 * i + 20) % 256, np.uint8) for i in range(n)])


def indices(frames: np.ndarray) -> list[int]:
    return [round((float(f.mean()) - 20) / 10) for f in frames]


@pytest.mark.parametrize("container", ["mp4", "webm", "mkv", "mov"])
def test_num_frames_are_evenly_spaced(container):
    raw = samples.video(graded(20), container=container, fps=10)  # 2.0 s
    out = decode_video(raw, num_frames=4, fps=0, limits=LIMITS, param="p")
    assert out.dtype == np.uint8 and out.shape == (4, 48, 64, 3)
    assert indices(out) == [2, 7, 12, 17]  # on screen at 0.25, 0.75, 1.25, 1.75 s


def test_fps_sampling():
    raw = samples.video(graded(20), fps=10)
    out = decode_video(raw, num_frames=0, fps=2.0, limits=LIMITS, param="p")
    assert indices(out) == [2, 7, 12, 17]  # every 0.5 s, at the middle of each interval
    assert indices(decode_video(raw, num_frames=0, fps=5.0, limits=LIMITS, param="p")) == [1, 3, 5, 7, 9, 11, 13,
                                                                                          15, 17, 19]


def test_more_frames_than_the_video_has_repeats_the_last():
    raw = samples.video(graded(3), fps=10)
    assert indices(decode_video(raw, num_frames=6, fps=0, limits=LIMITS, param="p")) == [0, 0, 1, 1, 2, 2]


def test_same_bytes_same_frames():
    raw = samples.video(samples.video_frames(12), fps=6)
    a = decode_video(raw, num_frames=5, fps=0, limits=LIMITS, param="p")
    b = decode_video(raw, num_frames=5, fps=0, limits=LIMITS, param="p")
    assert np.array_equal(a, b)


def test_sample_times():
    assert sample_times(2.0, num_frames=2, fps=0, max_frames=8, param="p") == [0.5, 1.5]
    assert sample_times(0.2, num_frames=0, fps=1.0, max_frames=8, param="p") == [0.5]  # at least one frame
    with pytest.raises(MediaError, match="gives 20 frames, above the limit of 8; ask for a lower fps"):
        sample_times(10.0, num_frames=0, fps=2.0, max_frames=8, param="p")


def fails(raw: bytes, *, limits=LIMITS, num_frames=4, fps=0.0) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode_video(raw, num_frames=num_frames, fps=fps, limits=limits, param="messages[0].content[0]")
    assert str(info.value).startswith("messages[0].content[0]: ")
    return info.value


def test_caps():
    raw = samples.video(graded(30), fps=10)  # 3 s
    err = fails(raw, limits=VideoLimits(2.5, 16, 256, 2_000))
    assert err.status == 413 and "3.0 s long, above the limit of 2.5 s" in str(err)
    err = fails(samples.video(graded(2, size=(320, 64))))
    assert err.status == 413 and "320x64, above the limit of 256 pixels per side" in str(err)
    err = fails(raw, limits=VideoLimits(60, 16, 256, 10))
    assert err.status == 413 and "more than 10 frames to decode" in str(err)


@pytest.mark.parametrize("raw, fragment", [
    (b"", "not a readable video container"),
    (b"garbage" * 100, "not a readable video container"),
    (samples.png((32, 32)), "container, which is not accepted"),
    (samples.wav(), "container, which is not accepted"),
])
def test_not_a_video(raw, fragment):
    err = fails(raw)
    assert err.status == 400 and fragment in str(err), str(err)


def test_truncated_and_corrupt():
    raw = samples.video(samples.video_frames(20), fps=10)
    for bad in (raw[: len(raw) // 3], raw[:64], raw[:200] + bytes(len(raw) - 200)):
        err = fails(bad)
        assert err.status in (400, 413), str(err)


def test_audio_only_webm_has_no_video_stream():
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="webm") as out:
        stream = out.add_stream("libopus", rate=48_000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.float32), format="flt", layout="mono")
        frame.sample_rate = 48_000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    err = fails(buf.getvalue())
    assert "has no video stream" in str(err)


def test_fit_frame_keeps_the_aspect_and_the_budget():
    assert fit_frame(640, 480, 640 * 480) == (640, 480)
    assert fit_frame(4096, 4096, 600_000) == (774, 774)
    assert fit_frame(1920, 1080, 100_000) == (421, 237)  # 16:9 still
    assert fit_frame(4096, 1, 100) == (100, 1)  # a side never below 1, the budget still kept
    for w, h, budget in ((4096, 4096, 1), (3000, 7, 50), (1281, 719, 307_200)):
        fw, fh = fit_frame(w, h, budget)
        assert fw * fh <= max(1, budget) and fw >= 1 and fh >= 1


BIG = VideoLimits(max_duration_s=60, max_frames=32, max_side=4096, max_decoded_frames=2_000)


def test_frames_are_scaled_into_the_pixel_budget_while_decoding():
    """16 frames of 1280x720 against a budget of 16 x 320x180: one array of the budget's size,
    aspect kept, the same frames sampled; numpy never holds full-size frames (tracemalloc sees
    numpy's allocations, not FFmpeg's: the RSS test below covers those)."""
    raw = samples.video(graded(16, size=(1280, 720)), fps=8)
    budget_pixels = 16 * 320 * 180
    limits = VideoLimits(60, 32, 4096, 2_000, max_pixels=budget_pixels)
    tracemalloc.start()
    try:
        out = decode_video(raw, num_frames=16, fps=0, limits=limits, param="p")
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (16, 180, 320, 3) and out.nbytes <= 3 * budget_pixels
    assert indices(out) == list(range(16))
    assert peak_bytes < 1.5 * out.nbytes, peak_bytes  # the stack of 16 full frames would be 44 MB
    small = decode_video(samples.video(graded(4), fps=8), num_frames=4, fps=0, limits=limits, param="p")
    assert small.shape == (4, 48, 64, 3)  # within the budget: untouched


def test_repeated_frames_stay_within_the_budget():
    raw = samples.video(graded(3, size=(640, 480)), fps=10)
    out = decode_video(raw, num_frames=6, fps=0, limits=VideoLimits(60, 32, 4096, 2_000, max_pixels=6 * 160 * 120),
                       param="p")
    assert out.shape == (6, 120, 160, 3) and indices(out) == [0, 0, 1, 1, 2, 2]


_PEAK = """
import resource, sys
import av  # loaded before the measure: its libraries are not the decode's cost
from shared.media.video import VideoLimits, decode_video
raw = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = decode_video(raw, num_frames=16, fps=0, param="p",
                   limits=VideoLimits(60, 32, 4096, 2_000, max_pixels=int(sys.argv[2])))
print(out.nbytes, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_a_high_resolution_video_costs_about_its_budget_not_its_frames(tmp_path):
    """16 frames of 2048x2048 (192 MiB as RGB, twice that while listed and stacked) decoded into
    16 x 256x256: the process's peak grows by far less than one stack of full frames."""
    path = tmp_path / "big.mp4"
    path.write_bytes(samples.video(graded(16, size=(2048, 2048)), fps=8))
    budget_pixels = 16 * 256 * 256
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(budget_pixels)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    nbytes, grown_bytes = map(int, run.stdout.split())
    assert nbytes <= 3 * budget_pixels
    assert grown_bytes < 96 * 2**20, grown_bytes  # decoder buffers of a few 2048x2048 frames; no full stack
