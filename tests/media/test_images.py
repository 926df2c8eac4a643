"""Image policy: format allowlist, pixel cap before decoding, EXIF orientation, RGB, corrupt and
polyglot inputs; plus a fuzz test (never anything but MediaError)."""

from __future__ import annotations

import io
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from shared.media.images import check_header, decode_image, sniff_format
from shared.media.sources import MediaError
from tests.media import samples

P = "messages[0].content[0]"
MAX_PIXELS = 1_000_000


def decode(raw: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    return decode_image(raw, max_pixels=max_pixels, param=P)


def refused(raw: bytes, max_pixels: int = MAX_PIXELS) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode(raw, max_pixels)
    assert str(info.value).startswith(P + ": ")
    return info.value


@pytest.mark.parametrize("make", [samples.png, samples.jpeg, samples.webp, samples.mpo, samples.png16,
                                  samples.cmyk_jpeg, samples.rgba_png, samples.palette_png, samples.apng,
                                  samples.animated_webp])
def test_accepted_formats_decode_to_rgb(make):
    img = decode(make())
    assert img.mode == "RGB" and img.size[0] > 0 and img.size[1] > 0
    img.tobytes()  # fully loaded


def test_lossless_pixels_are_preserved():
    src = samples.noise((33, 17), seed=5)
    for raw in (samples.encode(src, "PNG"), samples.encode(src, "WEBP", lossless=True)):
        assert np.array_equal(np.asarray(decode(raw)), np.asarray(src))


@pytest.mark.parametrize("make, name", [(samples.gif, "GIF"), (samples.bmp, "BMP"), (samples.tiff, "TIFF"),
                                        (samples.html_page, "HTML"), (samples.svg_image, "SVG"),
                                        (samples.zip_then_png, "ZIP"), (lambda: b"%PDF-1.7 ...", "PDF")])
def test_other_formats_are_refused_by_name(make, name):
    err = refused(make())
    assert err.status == 400 and err.code == "unsupported_media_type"
    assert name in str(err) and "JPEG, PNG or WEBP" in str(err)


def test_gif_refusal_says_what_to_send():
    assert "send the frame you mean as PNG" in str(refused(samples.gif()))


@pytest.mark.parametrize("raw", [b"", b"x", b"hello, I am plain text", b"\x00" * 100, bytes(range(256))])
def test_unrecognised_bytes(raw):
    err = refused(raw)
    assert "not a recognised image" in str(err) and err.status == 400


def test_pixel_bomb_header_is_refused_without_allocating():
    bomb = samples.png_claiming(100_000, 100_000)
    assert len(bomb) < 200
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        err = refused(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.status == 413 and err.code == "media_too_large"
    assert "pixels" in str(err)
    assert peak < 8 * 1024 * 1024, peak  # nothing close to 30 GB of pixels
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("w, h", [(1001, 1000), (20_000, 60), (1, 1_000_001), (65535, 65535)])
def test_over_the_pixel_cap_is_a_413_naming_the_size(w, h):
    err = refused(samples.png_claiming(w, h))
    assert err.status == 413
    if w * h < 178_956_970:  # Pillow's own bomb limit answers first above it
        assert f"{w}x{h} pixels" in str(err) and str(MAX_PIXELS) in str(err)


def test_zlib_bomb_under_the_cap_is_decoded_with_bounded_memory():
    raw = samples.png_zlib_bomb(1000, 1000)  # ~10 KB on the wire, 3 MB of pixels
    assert len(raw) < 20_000
    assert decode(raw).size == (1000, 1000)
    err = refused(samples.png_zlib_bomb(1500, 1000))  # the same trick above the cap: refused before inflating
    assert err.status == 413


def test_header_check_does_not_decode():
    img = check_header(samples.png((640, 480)), max_pixels=MAX_PIXELS, param=P)
    assert img.size == (640, 480) and img.format == "PNG"


@pytest.mark.parametrize("orientation, size", [(1, (40, 20)), (3, (40, 20)), (6, (20, 40)), (8, (20, 40))])
def test_exif_orientation_is_applied(orientation, size):
    assert decode(samples.jpeg_with_orientation(orientation)).size == size


def test_unreadable_exif_is_ignored():
    img = decode(samples.jpeg_with_garbage_exif())
    assert img.mode == "RGB"


@pytest.mark.parametrize("make", [samples.png, samples.jpeg, samples.webp])
@pytest.mark.parametrize("keep", [0.05, 0.5, 0.9])
def test_truncated_images_are_400(make, keep):
    raw = samples.truncated(make((64, 64)), keep)
    try:
        decode(raw)
    except MediaError as err:
        assert err.status == 400
        assert "corrupt or truncated" in str(err) or "not a readable" in str(err)
    else:  # a JPEG cut late can still decode (libjpeg pads); it must then be a proper RGB image
        assert make is samples.jpeg


def test_bad_crc_is_400():
    assert refused(samples.png_bad_crc()).status == 400


def test_polyglot_png_then_zip_decodes_as_the_png():
    expected = np.asarray(decode(samples.png(seed=3)))
    for _ in range(3):  # deterministic
        assert np.array_equal(np.asarray(decode(samples.png_then_zip())), expected)


def test_polyglot_zip_containing_png_is_refused():
    assert "ZIP" in str(refused(samples.zip_then_png()))


def test_html_behind_png_magic_is_a_corrupt_png():
    err = refused(samples.html_with_png_magic())
    assert err.status == 400 and "PNG" in str(err)


def test_jpeg_with_trailing_garbage_decodes():
    assert decode(samples.jpeg() + b"<html>trailing</html>" * 10).size == (48, 40)


def test_sniff_is_by_offset_zero_only():
    assert sniff_format(b"junk" + samples.png()) is None
    assert sniff_format(samples.png()) == "PNG"
    assert sniff_format(samples.webp()) == "WEBP"
    assert sniff_format(samples.jpeg()) == "JPEG"


# ---------------------------------------------------------------------------- fuzz
_SEEDS = [samples.png((24, 16)), samples.jpeg((24, 16)), samples.webp((24, 16)), samples.apng(),
          samples.jpeg_with_orientation(6, (16, 8)), samples.png_claiming(5000, 5000)]


def _check_outcome(raw: bytes) -> None:
    try:
        img = decode_image(raw, max_pixels=MAX_PIXELS, param=P)
    except MediaError as err:
        assert err.status in (400, 413, 422)
        assert str(err).startswith(P)
    else:
        assert img.mode == "RGB"
        assert img.size[0] * img.size[1] <= MAX_PIXELS


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(raw):
    _check_outcome(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(_SEEDS), data=st.data())
def test_fuzz_mutated_images(seed, data):
    raw = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 8), label="n_mutations")):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]), label="op")
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)), label="pos")
        if op == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[pos: pos + data.draw(st.integers(1, 64))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
    _check_outcome(bytes(raw))


@settings(max_examples=200, deadline=None)
@given(w=st.integers(0, 2**32 - 1), h=st.integers(0, 2**32 - 1), color=st.sampled_from([0, 2, 3, 4, 6, 7]))
def test_fuzz_png_headers(w, h, color):
    _check_outcome(samples.png_claiming(w, h, color_type=color))


def test_image_is_independent_of_the_input_buffer():
    raw = bytearray(samples.png())
    img = decode(bytes(raw))
    raw[:] = b"\x00" * len(raw)
    assert io.BytesIO(img.tobytes()).getbuffer().nbytes == 48 * 40 * 3
