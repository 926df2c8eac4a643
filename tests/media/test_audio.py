"""Audio decoding under the media policy: WAV/FLAC/OGG through soundfile, MP3/M4A through PyAV,
mono, resampled to the model's rate, duration cap from the header, and silent, empty, garbage
or truncated audio a 4xx naming the item. Clips are synthesised in the test."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shared.media.audio import decode_audio, sniff_audio
from shared.media.sources import MediaError

RATE = 16_000


def tone(seconds: float, rate: int, channels: int = 1, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def soundfile_bytes(data: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, data, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def av_bytes(data: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """``data`` (samples,) or (samples, 2) encoded by FFmpeg as a mono or stereo file."""
    import av

    layout = "stereo" if data.ndim == 2 else "mono"
    planar = data.T if data.ndim == 2 else data[None, :]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        frame_len = 1152
        for start in range(0, planar.shape[1], frame_len):
            chunk = np.ascontiguousarray(planar[:, start:start + frame_len], np.float32)
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            frame.sample_rate = rate
            frame.pts = start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, rate, channels", [("WAV", 44_100, 2), ("WAV", 16_000, 1), ("FLAC", 22_050, 1),
                                                  ("OGG", 48_000, 2)])
def test_soundfile_formats(fmt, rate, channels):
    raw = soundfile_bytes(tone(1.0, rate, channels), rate, fmt)
    assert sniff_audio(raw) == fmt
    out = decode_audio(raw, rate_hz=RATE, max_duration_s=10, param="p")
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(out.size - RATE) <= 64  # 1 s at the model's rate
    assert 0.25 < float(np.abs(out).max()) <= 0.35  # the tone survived resampling


@pytest.mark.parametrize("container, codec, fmt", [("mp3", "libmp3lame", "MP3"), ("ipod", "aac", "M4A")])
def test_av_formats(container, codec, fmt):
    raw = av_bytes(tone(1.0, 44_100), 44_100, container, codec)
    assert sniff_audio(raw) == fmt
    out = decode_audio(raw, rate_hz=RATE, max_duration_s=10, param="p")
    assert abs(out.size - RATE) < RATE * 0.1 and float(np.abs(out).max()) > 0.1


def test_stereo_is_averaged_alike_in_every_format():
    """One 0.8-peak stereo clip (a different tone each side) as WAV and as MP3 gives the same
    mono signal and the same log-mel features: channels are averaged, never summed and clipped."""
    from transformers import WhisperFeatureExtractor

    rate = 44_100
    t = np.arange(rate) / rate
    left, right = 0.8 * np.sin(2 * np.pi * 440 * t), 0.8 * np.sin(2 * np.pi * 660 * t)
    stereo = np.stack([left, right], axis=1).astype(np.float32)
    want = decode_audio(soundfile_bytes(((left + right) / 2).astype(np.float32), rate, "WAV"),
                        rate_hz=RATE, max_duration_s=10, param="p")
    clips = {"WAV": soundfile_bytes(stereo, rate, "WAV"),
             "MP3": av_bytes(stereo, rate, "mp3", "libmp3lame")}
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE)
    features = {}
    for fmt, raw in clips.items():
        out = decode_audio(raw, rate_hz=RATE, max_duration_s=10, param="p")
        assert abs(float(np.abs(out).max()) - float(np.abs(want).max())) < 0.05, fmt  # not 1.13, not clipped
        assert abs(out.size - want.size) < 0.02 * want.size, fmt
        features[fmt] = fe(out, sampling_rate=RATE, return_tensors="np")["input_features"][0]
    wav_f = fe(want, sampling_rate=RATE, return_tensors="np")["input_features"][0]
    assert np.abs(features["WAV"] - wav_f).max() < 0.02  # both 16-bit PCM, written apart
    # MP3 is lossy: the log-mel (range ~[-1, 1.5]) agrees to a few hundredths on average
    assert float(np.abs(features["MP3"] - wav_f).mean()) < 0.05


def fails(raw: bytes, max_duration_s: float = 10) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode_audio(raw, rate_hz=RATE, max_duration_s=max_duration_s, param="messages[0].content[0]")
    assert str(info.value).startswith("messages[0].content[0]: ")
    return info.value


def test_duration_cap_from_the_header():
    err = fails(soundfile_bytes(tone(3.0, 8_000), 8_000, "WAV"), max_duration_s=2)
    assert err.status == 413 and "3.0 s long, above the limit of 2 s" in str(err)
    err = fails(av_bytes(tone(3.0, 22_050), 22_050, "mp3", "libmp3lame"), max_duration_s=2)
    assert err.status == 413


@pytest.mark.parametrize("raw, fragment", [
    (b"", "not a recognised audio file"),
    (b"hello, plain text" * 10, "not a recognised audio file"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not a recognised audio file"),
    (soundfile_bytes(np.zeros(8_000, np.float32), 8_000, "WAV"), "silent"),
    (soundfile_bytes(np.zeros(0, np.float32), 8_000, "WAV"), "no samples"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 40, "WAV audio is corrupt"),
    (b"ID3" + b"\x00" * 200, "MP3"),
])
def test_bad_audio(raw, fragment):
    err = fails(raw)
    assert err.status == 400 and fragment in str(err), str(err)


def test_truncated_audio_is_a_4xx_or_shorter():
    raw = soundfile_bytes(tone(1.0, 16_000), 16_000, "FLAC")
    for cut in (raw[:40], raw[: len(raw) // 2]):
        try:
            out = decode_audio(cut, rate_hz=RATE, max_duration_s=10, param="p")
        except MediaError as err:
            assert err.status == 400
        else:  # libsndfile reads what is there: never more than the cut holds
            assert out.size < RATE
