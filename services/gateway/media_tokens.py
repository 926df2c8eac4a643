"""The tokens a chat's media item becomes in the served model's prompt, where the gateway knows
it without fetching the item (what ``/tokenize`` counts; vLLM's fetches and processes every
item first): embeddings parts by their rows; an image in a ``data:`` URL by its header's size
(EXIF orientation applied, as media-fetch decodes it) and the request's pixel budget, through the
model's own processor's count; an image by URL only where the family's count does not depend on
the image (LLaVA-1.5). Any other item (a Qwen2-VL or LLaVA-NeXT image by URL, video, audio) is a
400 naming its part. Design: docs/guide/api.md.
"""

from __future__ import annotations

from services.gateway.prompt import MediaInput
from shared.media.images import check_header
from shared.media.sources import MediaError
from shared.stage import RequestFailed

# families whose every image becomes the same number of tokens (the processor crops to one size)
SIZE_FREE_IMAGES = frozenset({"llava"})
_EXIF_ORIENTATION = 0x0112
_TURNED = (5, 6, 7, 8)  # orientations that swap width and height (as ImageOps.exif_transpose turns them)


class MediaTokens:
    def __init__(self, processor, *, family: str, max_image_pixels: int) -> None:
        self._processor = processor
        self._size_free = family in SIZE_FREE_IMAGES
        self._max_image_pixels = max_image_pixels

    @classmethod
    def for_model(cls, model_dir, *, max_image_pixels: int) -> MediaTokens:
        from transformers import AutoProcessor

        from shared.models.registry import family_of

        return cls(AutoProcessor.from_pretrained(model_dir), family=family_of(model_dir).name,
                   max_image_pixels=max_image_pixels)

    def count(self, item: MediaInput) -> int:
        """The item's tokens, or ``RequestFailed`` (400 naming its part) where only fetching it would tell."""
        if item.kind.endswith("_embeds"):
            return item.rows
        if item.uuid and item.data is None and not item.url:  # its size is in the fleet's cache, not here
            raise RequestFailed(400, f"{item.param}: /tokenize cannot count an item given by uuid alone; count "
                                     "with a completion's usage.prompt_tokens", param=item.param,
                                code="unsupported_parameter")
        if item.kind != "image" or (item.data is None and not self._size_free):
            what = "an image by URL" if item.kind == "image" else f"a {item.kind} item"
            raise RequestFailed(400, f"{item.param}: /tokenize cannot count {what}: the tokens it becomes depend on "
                                     "its content, known only once media-fetch loads it; send images inline (data: "
                                     "URLs) or as image_embeds, or count with a completion's usage.prompt_tokens",
                                param=item.param, code="unsupported_parameter")
        kw = {}
        if item.min_pixels or item.max_pixels:  # as media-fetch resizes (shared.engines.qwen2_vl.ImagePreprocessor)
            size = self._processor.image_processor.size  # (a budget is taken only where the processor has these)
            lo, hi = size["shortest_edge"], size["longest_edge"]
            kw = {"min_pixels": item.min_pixels or min(lo, item.max_pixels), "max_pixels": item.max_pixels or hi}
        try:
            counted = self._processor._get_num_multimodal_tokens(image_sizes=[self._size(item)], **kw)
        except ValueError as exc:  # the processor refuses this image (e.g. an extreme aspect ratio)
            raise RequestFailed.bad_request(f"{item.param}: the image cannot be processed by this model: "
                                            f"{str(exc)[:200]}", param=item.param) from None
        return int(counted.num_image_tokens[0])

    def _size(self, item: MediaInput) -> tuple[int, int]:
        """(height, width) as the image processor sees the image."""
        if item.data is None:  # a family whose count is the same for every size
            return 1, 1
        try:
            img = check_header(item.data, max_pixels=self._max_image_pixels, param=item.param)
        except MediaError as exc:
            raise RequestFailed(exc.status, str(exc), param=item.param, code=exc.code) from None
        width, height = img.size
        try:
            turned = img.getexif().get(_EXIF_ORIENTATION, 1) in _TURNED
        except Exception:  # an unreadable EXIF block: media-fetch shows the pixels as stored
            turned = False
        return (width, height) if turned else (height, width)
