"""Image decoding under the media policy (:func:`decode_image`): JPEG, PNG and WEBP only, the
format decided by the magic bytes and Pillow allowed to open only that one format; the pixel
cap checked from the header before any pixel is decoded (413 without allocating); EXIF
orientation applied; the result RGB. Truncated or corrupt data is a 400, and every exception
Pillow raises on untrusted bytes is a ``MediaError``, never a worker fault.

Design: docs/guide/media.md.
"""

from __future__ import annotations

import io
import re

from PIL import Image, ImageOps, UnidentifiedImageError

from shared.media.sources import MediaError

ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "WEBP"})
_ACCEPT = "send JPEG, PNG or WEBP"
# formats recognised only to name them in the refusal
_KNOWN = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
          (b"%PDF", "PDF"), (b"PK\x03\x04", "ZIP"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"))


def sniff_format(raw: bytes) -> str | None:
    """The image format named by the magic bytes at offset 0 (None when unrecognised)."""
    if raw.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WEBP"
    if raw[4:8] == b"ftyp" and raw[8:12] in (b"heic", b"heix", b"mif1", b"avif", b"avis"):
        return "HEIF/AVIF"
    head = raw[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) and b"<svg" in raw[:4096].lower():
        return "SVG"
    if head.startswith((b"<!doctype html", b"<html")):
        return "HTML"
    return next((name for magic, name in _KNOWN if raw.startswith(magic)), None)


def check_header(raw: bytes, *, max_pixels: int, param: str) -> Image.Image:
    """Format allowlist and pixel cap from the header alone; the lazily-loaded image."""
    fmt = sniff_format(raw)
    if fmt not in ALLOWED_FORMATS:
        if fmt == "GIF":
            raise MediaError(f"{param}: GIF images are not accepted; {_ACCEPT} (for an animated GIF, send the "
                             "frame you mean as PNG)", code="unsupported_media_type")
        what = f"{fmt}, which is not accepted" if fmt else "not a recognised image (no JPEG, PNG or WEBP signature)"
        raise MediaError(f"{param}: the data is {what}; {_ACCEPT}", code="unsupported_media_type")
    try:
        img = Image.open(io.BytesIO(raw), formats=[fmt])  # reads the header only
        width, height = img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(exc, max_pixels, param) from None
    except UnidentifiedImageError:
        raise MediaError(f"{param}: the data is not a readable {fmt} image (its header is corrupt)") from None
    except Exception as exc:  # anything Pillow raises on an unreadable header
        raise MediaError(f"{param}: the data is not a readable {fmt} image ({_short(exc)})") from None
    if img.format not in (fmt, "MPO") or width <= 0 or height <= 0:
        raise MediaError(f"{param}: the data is not a readable {fmt} image")
    if width * height > max_pixels:
        raise MediaError(f"{param}: image is {width}x{height} pixels, above the limit of {max_pixels} pixels; "
                         "send a smaller image", status=413, code="media_too_large")
    return img


def decode_image(raw: bytes, *, max_pixels: int, param: str) -> Image.Image:
    """Raw bytes → RGB ``PIL.Image`` (fully loaded), or ``MediaError``.

    - GIF is refused by decision: a GIF is either animated (which frames the model should see is
      the client's question) or a still that converts losslessly to PNG; the message says so.
      APNG / animated WEBP decode their first frame; JPEG with an MPO extension its primary image.
    - Polyglots are deterministic: a PNG with a ZIP appended decodes as the PNG (trailing bytes
      are ignored, though they are part of the hashed bytes); a ZIP or HTML document is refused
      whatever images it contains later; HTML behind a PNG signature is a corrupt PNG.
    - An unreadable EXIF block is ignored, as viewers do; alpha is dropped, palettes / CMYK /
      16-bit converted."""
    img = check_header(raw, max_pixels=max_pixels, param=param)
    fmt = img.format
    try:
        img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _too_many_pixels(exc, max_pixels, param) from None
    except Exception as exc:  # truncated or corrupt payloads, in whatever form Pillow reports them
        raise MediaError(f"{param}: the {fmt} image is corrupt or truncated ({_short(exc)})") from None
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # an unreadable EXIF block: show the pixels as stored
        pass
    try:
        return img.convert("RGB") if img.mode != "RGB" else img
    except Exception as exc:
        raise MediaError(f"{param}: the {fmt} image has an unsupported pixel format {img.mode} "
                         f"({_short(exc)})") from None


def _too_many_pixels(exc: BaseException, max_pixels: int, param: str) -> MediaError:
    """Pillow's own bomb guard answered first (its limit is ~179 M pixels): same 413 as ours."""
    m = re.search(r"\((\d+) pixels\)", str(exc))
    claimed = f"claims {m.group(1)} pixels" if m else "has too many pixels"
    return MediaError(f"{param}: image header {claimed}, above the limit of {max_pixels} pixels; send a smaller image",
                      status=413, code="media_too_large")


def _short(exc: BaseException) -> str:
    text = str(exc).split(" <_io.BytesIO", 1)[0]
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
