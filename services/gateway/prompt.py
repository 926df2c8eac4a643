"""Turning a validated OpenAI request into what the fleet runs: prompt token ids (one
placeholder token per media item, expanded later by prefill once the item's size is known),
the media items in prompt order, and the sampling parameters.

Pure functions over the tokenizer: every rejection is a ``RequestFailed`` carrying the HTTP
status and the JSON path of the offending field.

Design: docs/guide/api.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from services.gateway import defaults as generation
from services.gateway import media_names, media_parts, params, prompt_forms, schema, tools
from services.gateway.defaults import GenerationDefaults
from services.gateway.embeds_parts import EmbedsRules, read_part
from services.gateway.media_parts import MediaInput
from services.gateway.templates import model_chat_template, render_chat
from shared import protocol
from shared.media.sources import as_allowlist
from shared.settings import Settings
from shared.stage import RequestFailed

# OpenAI's input_audio.format values -> the MIME type its base64 data is checked as
_INPUT_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg"}


@dataclass
class Prepared:
    prompt_token_ids: list[int]
    media: list[MediaInput] = field(default_factory=list)
    sampling: protocol.Sampling = protocol.Sampling()
    stream: bool = False
    include_usage: bool = False
    tool_mode: str = ""  # services.gateway.tools: "" | "auto" | "forced"
    tool_max_calls: int = 0  # 0: any number; parallel_tool_calls false: the first call alone, as vLLM
    cache_salt: str = ""  # the request's (checked); with its tenant, its cache scope


class PromptBuilder:
    """Knows the model's tokenizer, chat template, the modalities it takes and their placeholder
    tokens (one per item in the rendered prompt).

    ``placeholders``: modality -> placeholder token; its keys are the modalities served (a part
    of any other modality is a 400 naming the modality and the model). Default: images only,
    with ``placeholder_token``.
    """

    def __init__(self, tokenizer, *, placeholder_token: str = "", max_model_len: int, settings: Settings,
                 placeholders: dict[str, str] | None = None, embeds_hidden_size: int = 0,
                 embeds_merge_size: int = 0, chat_template: str | None = None, pixel_budget: bool = False,
                 image_token_pixels: int = 0, defaults: GenerationDefaults = GenerationDefaults(),
                 embeds_time_step: bool = False) -> None:
        self._tok = tokenizer
        self._defaults = defaults  # the model's sampling defaults (services.gateway.defaults)
        # the model's template (see templates.py: setting, processor's, tokenizer's)
        self._template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self._placeholders = dict(placeholders) if placeholders is not None else {"image": placeholder_token}
        self._placeholder_ids = {tokenizer.convert_tokens_to_ids(t): t for t in self._placeholders.values()}
        self._max_model_len = max_model_len
        # *_embeds parts: accepted when the hidden size is known; a merge size > 0 means the
        # family's positions need the grid (Qwen2-VL: rows = t·h·w / merge²); Qwen2.5-VL videos a time step
        self._embeds_hidden = embeds_hidden_size
        self._embeds = EmbedsRules(embeds_hidden_size, max_model_len, settings.max_embeds_bytes,
                                   settings.embeds_torch_load, embeds_merge_size, embeds_time_step) \
            if embeds_hidden_size else None
        self._pixel_budget = pixel_budget  # the image processor takes min/max pixels per request (Qwen2-VL)
        # the bound on those pixels (image_token_pixels: pixels one image token covers)
        self._max_request_pixels = params.max_request_pixels(settings, token_pixels=image_token_pixels,
                                                             context_tokens=max_model_len)
        self._s = settings
        self._allow = as_allowlist(settings.media_allow_hosts)
        self._max_bytes = {"image": settings.max_image_bytes, "video": settings.max_video_bytes,
                           "audio": settings.max_audio_bytes}

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it."""
        return self._tok.decode([token_id])

    @property
    def context_tokens(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self):
        return self._tok

    @property
    def placeholder_ids(self) -> frozenset[int]:  # one per media item in a prompt
        return frozenset(self._placeholder_ids)

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(self._placeholders)

    @classmethod
    def for_model(cls, model_dir, settings: Settings, *, only: frozenset[str] | None = None) -> PromptBuilder:
        """The builder for a saved model: its tokenizer and chat template (the processor's before
        the tokenizer's, as real checkpoints keep them), the placeholders of the modalities its
        family takes (and the engine serves; ``only`` narrows them further), its context."""
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        from shared.models.registry import family_of, served_modalities, with_item_limits

        config = AutoConfig.from_pretrained(model_dir)
        max_len = getattr(getattr(config, "text_config", config), "max_position_embeddings", 4096)
        if settings.engine == "vllm" and settings.vllm_max_model_len_tokens:  # the engines' context, not the model's
            max_len = min(max_len, settings.vllm_max_model_len_tokens)
        if settings.engine == "sglang" and settings.sglang_context_length_tokens:
            max_len = min(max_len, settings.sglang_context_length_tokens)
        family = family_of(model_dir)
        served = served_modalities(family, settings.engine)
        settings = with_item_limits(settings, family)  # what the engine's model takes per prompt
        placeholders = {m: tok for m, tok in family.placeholders.items() if m in served and (only is None or m in only)}
        hidden = int(getattr(getattr(config, "text_config", config), "hidden_size", 0))
        merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 0) or 0) \
            if family.name in ("qwen2_vl", "qwen2_5_vl") else 0
        processor = AutoProcessor.from_pretrained(model_dir)
        tokenizer = getattr(processor, "tokenizer", None) or AutoTokenizer.from_pretrained(model_dir)
        return cls(tokenizer, max_model_len=max_len, settings=settings,
                   placeholders=placeholders, embeds_hidden_size=hidden if only is None else 0,
                   embeds_merge_size=merge, pixel_budget=family.name == "qwen2_vl",
                   embeds_time_step=family.name == "qwen2_5_vl",
                   image_token_pixels=_token_pixels(processor),
                   defaults=generation.load(model_dir, settings.generation_config),
                   chat_template=model_chat_template(settings.chat_template, processor, tokenizer))

    # ------------------------------------------------------------------ chat
    def chat(self, req: schema.ChatCompletionRequest) -> Prepared:
        ids, media, tool_plan = self.chat_prompt(req)
        if req.max_completion_tokens is None:  # (0 is a value, refused as such, not a missing one)
            sampling = self._sampling(req, req.max_tokens, len(ids))
        else:
            sampling = self._sampling(req, req.max_completion_tokens, len(ids), "max_completion_tokens")
        if tool_plan.structured is not None:  # a forced call: the grammar of the allowed calls
            if sampling.structured is not None:
                raise RequestFailed.bad_request("tool_choice forcing a call cannot be combined with "
                                                "response_format", param="tool_choice")
            sampling = msgspec.structs.replace(sampling, structured=tool_plan.structured)
        params.check_structured_engine(sampling, self._s, "tool_choice" if tool_plan.structured else "response_format")
        return Prepared(ids, media, sampling, req.stream, bool(req.stream_options and req.stream_options.include_usage),
                        tool_plan.mode, 1 if req.parallel_tool_calls is False else 0,
                        cache_salt=media_names.check_salt(req.cache_salt))

    def chat_prompt(self, req: schema.ChatCompletionRequest, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, within_context: bool = True,
                    ) -> tuple[list[int], list[MediaInput], tools.ToolPlan]:
        """A chat request's prompt ids (one placeholder per media item), its media in prompt order
        and its tool plan. ``within_context`` false: a prompt past the context is returned, not
        refused (/tokenize reports its length)."""
        self._check_common(req.model, req.n)
        if not req.messages:
            raise RequestFailed.bad_request("messages must contain at least one message", param="messages")
        media: list[MediaInput] = []
        rendered: list[dict] = []
        tool_plan = tools.plan(req.tools, req.tool_choice)
        pixels = params.pixel_budget(req.mm_processor_kwargs, supported=self._pixel_budget,
                                     max_pixels=self._max_request_pixels)
        for i, msg in enumerate(req.messages):
            tools.check_message(i, msg)
            # a message's name reaches the template, as vLLM passes it (templates that know it use it)
            rendered.append({"role": msg.role, "content": self._content(msg, i, media),
                             **({"name": msg.name} if msg.name is not None else {})})
        native = tools.template_knows_tools(req.chat_template or self._template)
        rendered = tools.render_messages(rendered, req.messages, tool_plan, native=native)
        params.media_limits({k: sum(1 for m in media if m.kind.removesuffix("_embeds") == k)
                             for k in ("image", "video", "audio")}, self._s)
        for m in media:
            if m.kind == "image":
                lo, hi = pixels
                m.min_pixels, m.max_pixels = lo, min(hi or m.max_pixels, m.max_pixels or hi)
        template_tools = {"tools": [{"type": "function", "function": f} for f in tool_plan.tools]} \
            if native and tool_plan.tools else {}
        if len(media) > self._s.max_media_items:
            raise RequestFailed(413, f"request has {len(media)} media items; the limit is {self._s.max_media_items}",
                                param="messages", code="too_many_media_items")
        text = render_chat(self._tok, self._template, rendered, req,
                           trust_request_template=self._s.trust_request_chat_template, **template_tools,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        # as vLLM's chat endpoint: the template writes the special tokens, none are added
        ids = self._tokenize(text, add_special_tokens=_flag(req.add_special_tokens, False),
                             within_context=within_context)
        if sum(1 for t in ids if t in self._placeholder_ids) != len(media):
            raise RequestFailed.bad_request(
                f"text may not contain the reserved tokens {', '.join(self._placeholder_ids.values())}",
                param="messages")
        return ids, media, tool_plan

    def _content(self, msg: schema.Message, i: int, media: list[MediaInput]):
        if msg.content is None or isinstance(msg.content, str):
            return msg.content or ""
        parts: list[dict] = []
        for j, part in enumerate(msg.content):
            param = f"messages[{i}].content[{j}]"
            match part:
                case schema.TextPart(text=text):
                    parts.append({"type": "text", "text": text})
                case schema.ImagePart(image_url=image_url, uuid=uuid):
                    image_url = image_url or schema.ImageURL("")
                    if msg.role != "user":
                        raise RequestFailed.bad_request(f"{param}: images are accepted in user messages only",
                                                        param=param)
                    if image_url.detail not in (None, "auto") and (
                            image_url.detail not in ("low", "high") or not self._pixel_budget):
                        raise RequestFailed.bad_request(
                            f"{param}.image_url.detail: must be auto, low or high" if self._pixel_budget else
                            f"{param}.image_url.detail: only 'auto' is supported by this model's processor",
                            param=f"{param}.image_url.detail", code="unsupported_parameter")
                    self._check_modality("image", "image_url", param)
                    media.append(self._media("image", image_url.url, param, uuid))
                    if image_url.detail == "low":  # a pixel budget, see params.DETAIL_LOW_MAX_PIXELS
                        media[-1].max_pixels = min(params.DETAIL_LOW_MAX_PIXELS, self._max_request_pixels)
                    parts.append({"type": "image"})
                case schema.VideoPart(video_url=video_url, uuid=uuid):
                    video_url = video_url or schema.MediaURL("")
                    self._check_modality("video", "video_url", param)
                    if msg.role != "user":
                        raise RequestFailed.bad_request(f"{param}: videos are accepted in user messages only",
                                                        param=param)
                    item = self._media("video", video_url.url, param, uuid)
                    item.num_frames, item.fps = media_parts.video_sampling(video_url, param, self._s.max_video_frames)
                    media.append(item)
                    parts.append({"type": "video"})
                case schema.ImageEmbedsPart() | schema.VideoEmbedsPart() | schema.AudioEmbedsPart():
                    modality = type(part).__struct_config__.tag.removesuffix("_embeds")
                    self._check_modality(modality, f"{modality}_embeds", param)
                    if msg.role != "user" and modality != "audio":  # (as the media parts of each modality)
                        raise RequestFailed.bad_request(f"{param}: {modality}s are accepted in user messages only",
                                                        param=param)
                    media.append(self._embeds_item(part, param))
                    parts.append({"type": modality})
                case schema.AudioURLPart(audio_url=audio_url, uuid=uuid):
                    self._check_modality("audio", "audio_url", param)
                    if audio_url and (audio_url.num_frames is not None or audio_url.fps is not None):
                        raise RequestFailed.bad_request(f"{param}.audio_url: num_frames and fps sample videos; an "
                                                        "audio clip is heard whole", param=f"{param}.audio_url",
                                                        code="unsupported_parameter")
                    media.append(self._media("audio", audio_url.url if audio_url else "", param, uuid))
                    parts.append({"type": "audio"})
                case schema.InputAudioPart(input_audio=input_audio, uuid=uuid):
                    self._check_modality("audio", "input_audio", param)
                    if input_audio is None:  # a named clip the fleet holds (or a 400 naming the part)
                        media.append(self._media("audio", "", param, uuid))
                        parts.append({"type": "audio"})
                        continue
                    mime = _INPUT_AUDIO_MIME.get(input_audio.format)
                    if mime is None:
                        raise RequestFailed.bad_request(f"{param}: input_audio.format must be one of "
                                                        f"{', '.join(_INPUT_AUDIO_MIME)}", param=param)
                    media.append(self._media("audio", f"data:{mime};base64,{input_audio.data}", param, uuid))
                    parts.append({"type": "audio"})
                case _:
                    kind = type(part).__struct_config__.tag
                    raise RequestFailed(400, f"{param}: {kind} content is not supported", param=param,
                                        code="unsupported_modality")
        return parts

    def _check_modality(self, modality: str, part: str, param: str) -> None:
        """A part of a modality the served model does not take is a 400 that names both."""
        if modality in self._placeholders:
            return
        accepts = ", ".join(["text", *(m for m in ("image", "video", "audio") if m in self._placeholders)])
        raise RequestFailed(400, f"{param}: model {self._s.served_model_name!r} does not accept {modality} input "
                                 f"({part} parts); it accepts {accepts}", param=param, code="unsupported_modality")

    def _embeds_item(self, part: schema.EmbedsPart, param: str) -> MediaInput:
        """Precomputed embeddings (services.gateway.embeds_parts), held inline as a checked .npy
        like a data: URL; encode passes them through."""
        if self._embeds is None:
            tag = type(part).__struct_config__.tag
            raise RequestFailed(400, f"{param}: this server does not take {tag}", param=param,
                                code="unsupported_modality")
        got = read_part(part, param, self._embeds)
        return MediaInput(got.kind, param, mime="npy", data=got.data, grid_thw=got.grid_thw, rows=got.rows,
                          second_per_grid_t=got.second_per_grid_t)

    def _media(self, kind: str, url: str, param: str, uuid: str | None = None) -> MediaInput:
        """The item of a part: by its ``uuid`` alone when it has one and no data (url null or ""),
        as vLLM takes it; else its data, checked (:meth:`_source`) and named by ``uuid``."""
        name = media_names.check_uuid(uuid, param)
        if name and not url.strip():
            return MediaInput(kind, param, uuid=name)
        item = media_parts.source(kind, url, param, max_bytes=self._max_bytes[kind], allow=self._allow,
                                  files_enabled=bool(self._s.media_file_root))
        item.uuid = name
        return item

    # ------------------------------------------------------------------ completions
    def completion(self, req: schema.CompletionRequest) -> Prepared:
        self._check_common(req.model, req.n)
        ids = self.completion_prompt(req.prompt, req.add_special_tokens)
        sampling = self._sampling(req, req.max_tokens, len(ids))
        params.check_structured_engine(sampling, self._s, "response_format")
        return Prepared(ids, [], sampling, req.stream, bool(req.stream_options and req.stream_options.include_usage),
                        cache_salt=media_names.check_salt(req.cache_salt))

    def completion_prompt(self, prompt: str | list, add_special_tokens, *, within_context: bool = True) -> list[int]:
        """As vLLM's completions endpoint: a text with the tokenizer's special tokens (a BOS where it
        adds one) unless ``add_special_tokens`` is false; token ids as given (``prompt_forms``)."""
        given = prompt_forms.single(prompt)
        if not isinstance(given, str):
            prompt_forms.check_token_ids(given, len(self._tok), "prompt")
        ids = self._tokenize(given, add_special_tokens=_flag(add_special_tokens, True), within_context=within_context,
                             param="prompt")
        reserved = sorted(self._placeholder_ids[t] for t in self._placeholder_ids.keys() & set(ids))
        if reserved:
            raise RequestFailed.bad_request(f"prompt may not contain the reserved token {reserved[0]}",
                                            param="prompt")
        return ids

    # ------------------------------------------------------------------ shared checks
    def _check_common(self, model: str, n: int | None) -> None:
        """The model; ``n`` and every other field is checked by ``params.check_fields``."""
        if model != self._s.served_model_name:
            raise RequestFailed(404, f"model {model!r} does not exist; this server serves "
                                     f"{self._s.served_model_name!r}", param="model", code="model_not_found")

    def _tokenize(self, text: str | list[int], *, add_special_tokens: bool, within_context: bool = True,
                  param: str = "messages") -> list[int]:
        """``text``'s ids (token ids: as given), within the context unless told otherwise."""
        ids = text if isinstance(text, list) else \
            list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        if within_context and len(ids) >= self._max_model_len:
            raise RequestFailed.bad_request(f"prompt is {len(ids)} tokens; the model's context is "
                                            f"{self._max_model_len} tokens", param=param,
                                            code="context_length_exceeded")
        return ids

    def _sampling(self, req, max_tokens: int | None, prompt_len: int, param: str = "max_tokens") -> protocol.Sampling:
        return params.sampling(req, self._s, max_tokens, len(self._tok), param, context_tokens=self._max_model_len,
                               prompt_len=prompt_len, defaults=self._defaults)


def _flag(value, default: bool) -> bool:
    """A request's ``add_special_tokens`` (vLLM's extra): a boolean, or the endpoint's default."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestFailed.bad_request("add_special_tokens must be true or false", param="add_special_tokens")
    return value


def _token_pixels(processor) -> int:
    """Pixels one image token covers, (patch · merge)², for image processors that have both
    (Qwen2-VL: 28²); 0 for the others."""
    image_processor = getattr(processor, "image_processor", None)
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    return (patch * merge) ** 2 if isinstance(patch, int) and isinstance(merge, int) else 0
