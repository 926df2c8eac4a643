"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes, answered by
the gateway itself with the generation routes' own rendering and tokenizing (``PromptBuilder``),
bounds (``bounds.decode_bounded``) and refusals by name; media counted as ``media_tokens``
says. A prompt past the context is counted, not refused: ``count`` against ``max_model_len`` is
what a client asks /tokenize for. Pure and blocking: the app runs it on the preparation pool
(``Frontend.answer_here``). Design: docs/guide/api.md.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from services.gateway import bounds, params, prompt_forms, schema
from services.gateway.frontend import rejections, too_deep, unknown_field
from services.gateway.media_tokens import MediaTokens
from services.gateway.prompt import PromptBuilder
from shared.settings import Settings
from shared.stage import RequestFailed


class TokenizeCompletion(Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(Struct, frozen=True, kw_only=True):
    model: str | None = None
    messages: list[schema.Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens, as for chat completions
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    tools: Any = None


class Detokenize(Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


class _Form(Struct):
    messages: msgspec.Raw = msgspec.Raw()  # present: the chat form (as vLLM tells the two apart)


_DECODERS = {True: msgspec.json.Decoder(TokenizeChat), False: msgspec.json.Decoder(TokenizeCompletion)}
_FIELDS = {True: frozenset(TokenizeChat.__struct_fields__), False: frozenset(TokenizeCompletion.__struct_fields__)}
_form = msgspec.json.Decoder(_Form)
_detokenize = msgspec.json.Decoder(Detokenize)


class Tokenization:
    """What the two routes answer for the served model; each method raises ``Rejected``."""

    def __init__(self, builder: PromptBuilder, settings: Settings, media: MediaTokens) -> None:
        self._builder = builder
        self._s = settings
        self._media = media

    def tokenize(self, body: bytes) -> dict:
        """``{"count", "max_model_len", "tokens", "token_strs"}`` (token strings only when asked)."""
        s, context = self._s, self._builder.context_tokens
        with rejections():
            bounds.check_json_values(body, s, context)  # before the pass that tells the two forms apart
            chat = len(_form.decode(body).messages) > 0
            req, sent = bounds.decode_bounded(body, s, chat=chat, context_tokens=context,
                                              decode=_DECODERS[chat].decode)
            if chat and schema.too_deep(_free_form(req)):
                raise too_deep()
            self._check_known(sent, _FIELDS[chat], chat=chat)
            self._check_model(req.model)
            if chat:
                ids = self._chat(req)
            else:
                ids = self._builder.completion_prompt(req.prompt, req.add_special_tokens, within_context=False)
        strs = self._builder.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: bytes) -> dict:
        """``{"prompt"}``: the ids' text, special tokens included (as vLLM decodes them)."""
        context = self._builder.context_tokens
        with rejections():
            bounds.check_json_values(body, self._s, context)
            self._check_known(schema.as_sent(body, chat=False), frozenset(Detokenize.__struct_fields__), chat=False)
            req = _detokenize.decode(body)
            self._check_model(req.model)
            if len(req.tokens) > context:
                raise RequestFailed.bad_request(f"tokens: {len(req.tokens)} token ids; no sequence of this model is "
                                                f"longer than its context of {context}", param="tokens")
            tok = self._builder.tokenizer
            prompt_forms.check_token_ids(req.tokens, len(tok), "tokens")
        return {"prompt": tok.decode(req.tokens)}

    def _chat(self, req: TokenizeChat) -> list[int]:
        if req.continue_final_message and req.add_generation_prompt:
            raise RequestFailed.bad_request("continue_final_message continues the last message, so it needs "
                                            "add_generation_prompt: false", param="continue_final_message")
        # the chat completion it would be: the same messages, template and checks
        as_chat = schema.ChatCompletionRequest(
            model=self._s.served_model_name, messages=req.messages, tools=req.tools, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, mm_processor_kwargs=req.mm_processor_kwargs,
            add_special_tokens=req.add_special_tokens)
        params.check_fields(as_chat, chat=True)
        ids, media, _ = self._builder.chat_prompt(as_chat, add_generation_prompt=req.add_generation_prompt,
                                                  continue_final_message=req.continue_final_message,
                                                  within_context=False)
        return expand(ids, self._builder.placeholder_ids, [self._media.count(m) for m in media])

    def _check_known(self, sent: schema.AsSent, fields: frozenset[str], *, chat: bool) -> None:
        if self._s.allow_extra_request_fields:
            return
        unknown = [k for k in sent.top if k not in fields]
        if chat:  # the messages' fields, as chat completions check them
            unknown += schema.unknown_fields(msgspec.structs.replace(sent, top={}), chat=True)
        if unknown:
            raise unknown_field(unknown[0])

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._s.served_model_name:
            raise RequestFailed(404, f"model {model!r} does not exist; this server serves "
                                     f"{self._s.served_model_name!r}", param="model", code="model_not_found")


def expand(ids: list[int], placeholders: frozenset[int], counts: list[int]) -> list[int]:
    """``ids`` with the i-th placeholder repeated ``counts[i]`` times, as the model sees its prompt."""
    out: list[int] = []
    left = iter(counts)
    for t in ids:
        out.extend([t] * next(left) if t in placeholders else (t,))
    return out


def _free_form(req: TokenizeChat) -> list:
    values = [req.chat_template_kwargs, req.mm_processor_kwargs, req.tools]
    values += [getattr(m, name) for m in req.messages for name in schema.MESSAGE_FREE_FORM]
    return [v for v in values if v is not None]
