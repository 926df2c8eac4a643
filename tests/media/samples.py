"""Image payloads for media tests, good and bad, built in memory (no files shipped)."""

from __future__ import annotations

import base64
import io
import struct
import zipfile
import zlib

import numpy as np
from PIL import Image


def noise(size=(48, 40), seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return img if mode == "RGB" else img.convert(mode)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png(size=(48, 40), seed: int = 0) -> bytes:
    return encode(noise(size, seed), "PNG")


def jpeg(size=(48, 40), seed: int = 0) -> bytes:
    return encode(noise(size, seed), "JPEG", quality=90)


def webp(size=(48, 40), seed: int = 0) -> bytes:
    return encode(noise(size, seed), "WEBP", lossless=True)


def gif(size=(16, 16)) -> bytes:
    return encode(noise(size).convert("P"), "GIF")


def bmp(size=(16, 16)) -> bytes:
    return encode(noise(size), "BMP")


def tiff(size=(16, 16)) -> bytes:
    return encode(noise(size), "TIFF")


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int, *, color_type: int = 2) -> bytes:
    """A tiny, well-formed PNG whose header claims ``width`` x ``height`` (a pixel bomb)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + _chunk(b"IEND", b""))


def png_zlib_bomb(width: int = 4000, height: int = 4000) -> bytes:
    """A real PNG that is tiny compressed and ``width*height*3`` bytes decoded."""
    raw = (b"\x00" + b"\x00" * (width * 3)) * height
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


def png_bad_crc() -> bytes:
    good = bytearray(png())
    good[29] ^= 0xFF  # inside the IHDR CRC
    return bytes(good)


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def png_then_zip() -> bytes:
    """Both a valid PNG (from offset 0) and a valid ZIP (its directory is at the end)."""
    return png(seed=3) + zip_bytes({"payload.txt": b"hello from the zip"})


def zip_then_png() -> bytes:
    """A ZIP archive that contains a PNG: not an image."""
    return zip_bytes({"image.png": png(seed=4)})


def html_with_png_magic() -> bytes:
    return b"\x89PNG\r\n\x1a\n<html><body><script>alert(1)</script></body></html>"


def html_page() -> bytes:
    return b"<!DOCTYPE html><html><body><img src=x></body></html>"


def svg_image() -> bytes:
    return b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'


def jpeg_with_orientation(orientation: int, size=(40, 20)) -> bytes:
    img = noise(size, seed=9)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", exif=exif.tobytes(), quality=95)


def jpeg_with_garbage_exif() -> bytes:
    raw = bytearray(jpeg_with_orientation(6))
    i = raw.find(b"Exif\x00\x00")
    raw[i + 6:i + 30] = b"\xde\xad\xbe\xef" * 6  # a broken TIFF header inside APP1
    return bytes(raw)


def truncated(raw: bytes, keep: float = 0.5) -> bytes:
    return raw[: max(1, int(len(raw) * keep))]


def mpo(size=(32, 24)) -> bytes:
    return encode(noise(size), "MPO")


def animated_webp() -> bytes:
    frames = [noise((24, 24), seed=s) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], lossless=True)
    return buf.getvalue()


def apng() -> bytes:
    frames = [noise((24, 24), seed=s) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def png16() -> bytes:
    return encode(Image.new("I;16", (8, 8), 40000), "PNG")


def cmyk_jpeg() -> bytes:
    return encode(noise((16, 16)).convert("CMYK"), "JPEG")


def rgba_png() -> bytes:
    return encode(noise((16, 16)).convert("RGBA"), "PNG")


def palette_png() -> bytes:
    return encode(noise((16, 16)).convert("P"), "PNG")


# ---------------------------------------------------------------------------- video
def video_frames(n: int, size: tuple[int, int] = (64, 48), seed: int = 0) -> np.ndarray:
    """``uint8 [n, h, w, 3]``: each frame different (a moving bar over seeded noise)."""
    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    frames = np.repeat(base[None], n, axis=0)
    for i in range(n):
        x = (i * 7) % w
        frames[i, :, x:x + 6] = (255, 255 - 20 * (i % 10), 40)
    return frames


def video(frames: np.ndarray, *, container: str = "mp4", fps: int = 10) -> bytes:
    """Encode frames with PyAV: ``mp4`` (MPEG-4 part 2, lossless enough and fast) or ``webm``
    (VP8). Deterministic for the same frames."""
    import av

    buf = io.BytesIO()
    codec = {"mp4": "mpeg4", "webm": "libvpx", "mkv": "mpeg4", "mov": "mpeg4"}[container]
    fmt = {"mkv": "matroska"}.get(container, container)
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"} if codec == "mpeg4" else {}
        for arr in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 16_000, freq: float = 440.0) -> bytes:
    """A mono 16-bit PCM WAV (a sine): audio that is not a video."""
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
