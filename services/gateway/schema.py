"""The OpenAI request bodies the gateway accepts, as msgspec Structs.

Decoding a body with :func:`parse_chat` / :func:`parse_completion` validates its shape in one
pass; errors name the offending JSON path (``$.messages[0].content[1].type``), returned in a
400 (``param``). Every field OpenAI (or vLLM, for its sampling extras) defines for these
endpoints is declared here, so none is dropped unseen (what is done with each:
:mod:`services.gateway.params`). A top-level field declared nowhere is refused
(:func:`unknown_fields`) unless ``allow_extra_request_fields``. Design: docs/guide/api.md.
"""

from __future__ import annotations

import re
import typing
from typing import Any, Literal, Union

import msgspec
from msgspec import Struct


class ImageURL(Struct, frozen=True):
    url: str
    detail: str | None = None


class MediaURL(Struct, frozen=True):
    url: str
    # video only (mmfleet extension): how to sample frames; at most one of the two
    num_frames: int | None = None
    fps: float | None = None


class InputAudio(Struct, frozen=True):
    data: str
    format: str


class EmbedsData(Struct, frozen=True):
    """Precomputed image embeddings as an object: mmfleet's form (``data``: base64 of one .npy,
    safetensors or torch.save file holding float [n_tokens, hidden]; ``format``; ``grid_thw``:
    the patch grid they were encoded with, Qwen2-VL's positions depend on it) or vLLM's dict form
    (``image_embeds`` + ``image_grid_thw``, a base64 tensor or a JSON list). One form per part:
    services/gateway/embeds_parts.py reads them."""

    data: str | None = None
    format: str | None = None
    grid_thw: list[int] | None = None
    image_embeds: str | None = None
    image_grid_thw: str | list[int | list[int]] | None = None


class VideoEmbedsData(Struct, frozen=True):
    """As :class:`EmbedsData` for a video; ``second_per_grid_ts``: Qwen2.5-VL's time step."""

    data: str | None = None
    format: str | None = None
    grid_thw: list[int] | None = None
    video_embeds: str | None = None
    video_grid_thw: str | list[int | list[int]] | None = None
    second_per_grid_ts: str | list[float] | None = None


class AudioEmbedsData(Struct, frozen=True):
    """As :class:`EmbedsData` for an audio clip; ``audio_num_tokens``: its rows, if sent."""

    data: str | None = None
    format: str | None = None
    audio_embeds: str | None = None
    audio_num_tokens: str | list[int] | None = None


class TextPart(Struct, frozen=True, tag="text", tag_field="type"):
    text: str


# ``uuid`` (vLLM's): the client's name for the item; with no data (the part's url null or "")
# the item is the one the fleet cached under that name (services.gateway.media_names)
class ImagePart(Struct, frozen=True, tag="image_url", tag_field="type"):
    image_url: ImageURL | None = None
    uuid: str | None = None


class VideoPart(Struct, frozen=True, tag="video_url", tag_field="type"):
    video_url: MediaURL | None = None
    uuid: str | None = None


class AudioURLPart(Struct, frozen=True, tag="audio_url", tag_field="type"):
    audio_url: MediaURL | None = None
    uuid: str | None = None


class InputAudioPart(Struct, frozen=True, tag="input_audio", tag_field="type"):
    input_audio: InputAudio | None = None
    uuid: str | None = None


# embeddings parts: a base64 payload (vLLM's string form) or an object (above); ``uuid``: vLLM's
# name for the item, accepted with no effect (an embeds item is never cached, see docs/guide/api.md)
class ImageEmbedsPart(Struct, frozen=True, tag="image_embeds", tag_field="type"):
    image_embeds: str | EmbedsData
    uuid: str | None = None


class VideoEmbedsPart(Struct, frozen=True, tag="video_embeds", tag_field="type"):
    video_embeds: str | VideoEmbedsData
    uuid: str | None = None


class AudioEmbedsPart(Struct, frozen=True, tag="audio_embeds", tag_field="type"):
    audio_embeds: str | AudioEmbedsData
    uuid: str | None = None


EmbedsPart = Union[ImageEmbedsPart, VideoEmbedsPart, AudioEmbedsPart]
Part = Union[TextPart, ImagePart, VideoPart, AudioURLPart, InputAudioPart, ImageEmbedsPart, VideoEmbedsPart,
             AudioEmbedsPart]


class Message(Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Part] | None = None
    name: str | None = None
    # tool use (refused by name until tools are served, see services.gateway.params)
    tool_calls: Any = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None


class StreamOptions(Struct, frozen=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (refused, see params)


class _GenerationParams(Struct, frozen=True, kw_only=True):
    """Fields chat and text completions share (OpenAI's, then vLLM's sampling extras)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that cannot change the answer (accepted, no effect)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's: scopes every cache the request may hit (services.gateway.media_names.cache_scope)
    cache_salt: str | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's other extras, declared so a refusal can name them (see params.REFUSED)
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    priority: Any = None
    request_id: Any = None
    return_tokens_as_token_ids: Any = None
    add_special_tokens: Any = None
    response_format: Any = None
    echo: Any = None


class ChatCompletionRequest(_GenerationParams, frozen=True, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # vLLM chat extras: a template for this request (only where the operator allows it) and
    # variables for the template (services/gateway/templates.py)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None


class CompletionRequest(_GenerationParams, frozen=True, kw_only=True):
    # a text, token ids, or a list of either as OpenAI / vLLM take it; one prompt is served
    # (services.gateway.prompt_forms)
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_keys_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHAT_FIELDS = frozenset(ChatCompletionRequest.__struct_fields__)
_COMPLETION_FIELDS = frozenset(CompletionRequest.__struct_fields__)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` with a JSON path."""
    return _chat_decoder.decode(body)


def parse_completion(body: bytes) -> CompletionRequest:
    return _completion_decoder.decode(body)


class _MessageKeys(Struct):
    messages: list[dict[str, msgspec.Raw]] = []  # (a non-list is refused by the typed decode after)


_message_keys_decoder = msgspec.json.Decoder(_MessageKeys)
_MESSAGE_FIELDS = frozenset(Message.__struct_fields__)


MAX_JSON_DEPTH = 64  # nesting of a request's free-form values (tools, schemas, kwargs): deeper is a 400


def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (a decoded request, or any part of it) nests containers deeper than
    ``limit``; iterative, so a hostile nesting costs no recursion here or later."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, msgspec.Struct):
            children = (getattr(item, f) for f in item.__struct_fields__)
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def json_values_at_most(body: bytes) -> int:
    """An upper bound, read before decoding, on the JSON values a body's containers hold: every
    value after a container's first follows a comma (commas inside strings count too, so a long
    text over-counts: the bound errs towards refusing, never towards decoding more)."""
    return body.count(b",") + 1


def _free_form_names(struct: type[Struct]) -> tuple[str, ...]:
    """Fields whose values are arbitrary JSON (``Any``, ``dict[str, Any]``): the only places a
    decoded request can nest without a bound its types set."""
    hints = typing.get_type_hints(struct)
    return tuple(name for name in struct.__struct_fields__ if "Any" in str(hints[name]))


_FREE_FORM = {True: _free_form_names(ChatCompletionRequest), False: _free_form_names(CompletionRequest)}
MESSAGE_FREE_FORM = _free_form_names(Message)


def free_form_fields(*, chat: bool) -> tuple[str, ...]:
    return _FREE_FORM[chat]


def free_form(req, *, chat: bool) -> list:
    """The request's arbitrary-JSON values (its messages' too), to be walked by :func:`too_deep`."""
    out = [v for name in _FREE_FORM[chat] if (v := getattr(req, name)) is not None]
    if chat:
        out += [v for m in req.messages for name in MESSAGE_FREE_FORM if (v := getattr(m, name)) is not None]
    return out


class AsSent(Struct, frozen=True):
    """A body's fields as the JSON text they were sent as (:func:`as_sent`): the top level's and
    (chat) each message's, so sizes and unknown keys can be checked before any value is decoded."""

    top: dict[str, msgspec.Raw]
    messages: list[dict[str, msgspec.Raw]] = []


def as_sent(body: bytes, *, chat: bool) -> AsSent:
    """One pass (two for chat) that builds nothing below the fields it names. Raises
    ``msgspec.DecodeError`` / ``ValidationError`` for a body that is not a JSON object."""
    top = _keys_decoder.decode(body)
    return AsSent(top, _message_keys_decoder.decode(body).messages if chat else [])


def unknown_fields(sent: AsSent, *, chat: bool) -> list[str]:
    """Keys of a body (:func:`as_sent`) that this schema does not declare, at any depth the
    schema types (a content part, its ``image_url``, ``stream_options``, ...), as request paths
    in body order: top-level ones, then each message's."""
    struct = ChatCompletionRequest if chat else CompletionRequest
    out = [k for k in sent.top if k not in struct.__struct_fields__]
    for name, raw in sent.top.items():
        if name in _NESTED[struct] and name != "messages":
            _unknown_in(raw, _NESTED[struct][name], name, out)
    for i, m in enumerate(sent.messages):
        for k, raw in m.items():
            if k not in _MESSAGE_FIELDS:
                out.append(f"messages[{i}].{k}")
            elif k in _NESTED[Message]:
                _unknown_in(raw, _NESTED[Message][k], f"messages[{i}].{k}", out)
    return out


def _structs_in(tp) -> tuple[type[Struct], ...]:
    """The Struct types a field's value may be (directly, in a union or as list items)."""
    if isinstance(tp, type) and issubclass(tp, Struct):
        return (tp,)
    return tuple(s for arg in typing.get_args(tp) for s in _structs_in(arg))


def _nested(struct: type[Struct]) -> dict[str, tuple[type[Struct], ...]]:
    hints = typing.get_type_hints(struct)
    return {name: found for name in struct.__struct_fields__ if (found := _structs_in(hints[name]))}


_NESTED = {s: _nested(s) for s in (ChatCompletionRequest, CompletionRequest, Message, *typing.get_args(Part),
                                   ImageURL, MediaURL, InputAudio, EmbedsData, VideoEmbedsData, AudioEmbedsData,
                                   StreamOptions)}
_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])
_tag = msgspec.json.Decoder(str)


def _unknown_in(raw: msgspec.Raw, structs: tuple[type[Struct], ...], path: str, out: list[str]) -> None:
    """Append the paths of keys no candidate struct declares, in ``raw`` (an object, or a list of
    them). A tagged union picks its struct by the ``type`` key; a value of another shape, or a tag
    no struct has, is left to the typed decode, which refuses it by name."""
    text = bytes(raw).lstrip()
    if text[:1] == b"[":
        for j, item in enumerate(_raw_list.decode(text)):
            _unknown_in(item, structs, f"{path}[{j}]", out)
        return
    if text[:1] != b"{":
        return
    obj = _raw_object.decode(text)
    struct = structs[0] if len(structs) == 1 else None
    if struct is None and "type" in obj:
        try:
            tag = _tag.decode(obj["type"])
        except msgspec.ValidationError:
            return
        struct = next((s for s in structs if s.__struct_config__.tag == tag), None)
    if struct is None:
        return
    tag_field = struct.__struct_config__.tag_field
    for k, value in obj.items():
        if k not in struct.__struct_fields__ and k != tag_field:
            out.append(f"{path}.{k}")
        elif k in _NESTED.get(struct, {}):
            _unknown_in(value, _NESTED[struct][k], f"{path}.{k}", out)


def error_param(exc: msgspec.ValidationError) -> str | None:
    """The request path of a validation error (``messages[0].role``; a missing field's own
    path), or None when it names none."""
    text = str(exc)
    mark = text.rfind("- at `$")
    path = text[mark + len("- at `$"):].rstrip("`").lstrip(".") if mark >= 0 else ""
    missing = re.match(r"Object missing required field `(\w+)`", text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None
