"""Image decoding under the media policy: format allowlist, pixel cap checked from the header
before the full decode (decompression bombs), EXIF orientation, RGB.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from shared.media.sources import MediaError

ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "WEBP"})


def decode_image(raw: bytes, *, max_pixels: int, param: str) -> Image.Image:
    """Raw bytes → RGB ``PIL.Image`` (fully loaded), or ``MediaError``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))  # reads the header only
            if img.format not in ALLOWED_FORMATS:
                raise MediaError(
                    f"{param}: image format {img.format or 'unknown'} is not accepted; send JPEG, PNG or WEBP",
                    code="unsupported_media_type",
                )
            width, height = img.size
            if width * height > max_pixels:
                raise MediaError(f"{param}: image is {width}x{height} pixels, above the limit of {max_pixels} pixels",
                                 status=413, code="media_too_large")
            img.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(f"{param}: the data is not a readable JPEG, PNG or WEBP image") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt payloads
        raise MediaError(f"{param}: the image is corrupt or truncated ({exc})") from None
    img = ImageOps.exif_transpose(img)
    return img.convert("RGB") if img.mode != "RGB" else img
