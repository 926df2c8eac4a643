"""The OpenAI request bodies the gateway accepts, as msgspec Structs.

Decoding a body with :func:`parse_chat` validates its shape in one pass and yields errors that
name the offending JSON path (``$.messages[0].content[1].type``), which go back to the client
verbatim in a 400. Fields OpenAI defines but mmfleet ignores harmlessly (``user``,
``metadata``...) are accepted and dropped; unknown fields are ignored like OpenAI does.
"""

from __future__ import annotations

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
    """Precomputed image embeddings (mmfleet extension): base64 of one .npy or safetensors file
    holding float [n_tokens, hidden]; ``grid_thw``: the patch grid they were encoded with
    (required by Qwen2-VL, whose positions depend on it)."""

    data: str
    format: str = "npy"
    grid_thw: list[int] | None = None


class TextPart(Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ImagePart(Struct, frozen=True, tag="image_url", tag_field="type"):
    image_url: ImageURL


class VideoPart(Struct, frozen=True, tag="video_url", tag_field="type"):
    video_url: MediaURL


class AudioURLPart(Struct, frozen=True, tag="audio_url", tag_field="type"):
    audio_url: MediaURL


class InputAudioPart(Struct, frozen=True, tag="input_audio", tag_field="type"):
    input_audio: InputAudio


class ImageEmbedsPart(Struct, frozen=True, tag="image_embeds", tag_field="type"):
    image_embeds: EmbedsData


Part = Union[TextPart, ImagePart, VideoPart, AudioURLPart, InputAudioPart, ImageEmbedsPart]


class Message(Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None


class StreamOptions(Struct, frozen=True):
    include_usage: bool = False


class _GenerationParams(Struct, frozen=True, kw_only=True):
    """Fields chat and text completions share."""

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


class ChatCompletionRequest(_GenerationParams, frozen=True, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    # vLLM's extensions: a template for this request (only where the operator allows it) and
    # variables for the template (services/gateway/templates.py)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_GenerationParams, frozen=True, kw_only=True):
    prompt: str


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` with a JSON path."""
    return _chat_decoder.decode(body)


def parse_completion(body: bytes) -> CompletionRequest:
    return _completion_decoder.decode(body)
